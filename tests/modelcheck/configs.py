"""What ``scripts/modelcheck`` checks: the configurations of each model, and the mutants
that must fail in them.

A configuration is a set of -D values for a model (protocol.pml or pd.pml): sizes, fault
budgets, ranks; it is searched exhaustively (states stored collapsed) or, for the larger
ones, by bitstate search (a partial search that can only find errors, never prove their
absence). ``ci`` marks the small ones CI runs (tests/modelcheck/test_model.py): their
mutants, and their passing search unless ``ci_search`` is False (searches of 10-20 s that
the test command's 12-minute budget cannot take; ``scripts/modelcheck`` runs them, and
their mutants still run in CI); ``liveness`` adds a search for an acceptance cycle of the
model's LTL claim under weak fairness.

A mutant is a -D flag that breaks one rule of the protocol in the model; it must fail,
with a counterexample, in the configuration named (an equivalent mutant, which changes
nothing the protocol relies on, must pass, and says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PROTOCOL, PD = "protocol.pml", "pd.pml"


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    name: str
    model: str
    defines: dict[str, int] = field(default_factory=dict)
    what: str
    bitstate: bool = False
    liveness: bool = False
    ci: bool = False
    ci_search: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class Mutant:
    flag: str
    config: str  # the configuration it runs in
    what: str
    caught_by: tuple[str, ...] = ()  # the properties whose violation may show it
    equivalent: str = ""  # why it cannot fail (then it must pass)
    liveness: bool = False  # caught by the liveness search (a cycle), not by the safety one


CONFIGS = (
    # Small: every interleaving, in seconds; CI runs these.
    Config(name="lanes", model=PROTOCOL, defines={"NOPS": 3}, ci=True,
           what="3 ops on 2 device and 2 host blocks, every op a scheduler could issue"),
    Config(name="lanes-live", model=PROTOCOL, defines={"NOPS": 2}, ci=True, liveness=True,
           what="2 ops: every op completes or is cancelled under weak fairness"),
    Config(name="crash", model=PROTOCOL, defines={"NOPS": 3, "LANE_CRASHES": 1}, ci=True,
           what="a Transfer lane crashes mid copy or before its report, and redoes the op"),
    Config(name="fail", model=PROTOCOL, defines={"NOPS": 3, "MAXFAIL": 1}, ci=True,
           what="an op fails and spoils what it wrote"),
    Config(name="worker", model=PROTOCOL, defines={"NOPS": 2, "WORKER_RESTARTS": 1}, ci=True,
           what="the Worker dies at any point: new tier epoch, stale ops cancelled"),
    Config(name="restarts", model=PROTOCOL,
           defines={"NOPS": 3, "ND": 1, "NH": 1, "WORKER_RESTARTS": 1, "LANE_CRASHES": 1},
           ci=True, ci_search=False,
           what="a Worker restart and a lane crash in one run, on one block a tier"),
    Config(name="engine", model=PROTOCOL, defines={"NOPS": 3, "ENGINE_RESTARTS": 1}, ci=True,
           ci_search=False,
           what="the engine restarts: new issuer epoch, Resync, a fresh tracker"),
    Config(name="ranks", model=PROTOCOL, defines={"NR": 2, "NOPS": 2, "ND": 1, "NH": 1},
           ci=True, what="tensor parallelism: 2 ranks on 1 device and 1 host block"),
    Config(name="i3", model=PROTOCOL, defines={"NOPS": 4, "NH": 1}, ci=True,
           what="4 ops on 2 device blocks and 1 host block: room for I3's case (a step "
           "reads a block, it is freed, a swap-in of a swapped-out copy overwrites it)"),
    Config(name="wake", model=PROTOCOL, defines={"NOPS": 2, "WAKEUPS": True}, ci=True,
           liveness=True,
           what="the wait as the code runs it (doorbell, deadline, checked again): a cycle; "
           "every op completes under weak fairness, and only under it"),
    Config(name="steps", model=PROTOCOL,
           defines={"NOPS": 3, "NH": 1, "STEPS": 2, "MAXFAIL": 1}, ci=True, ci_search=False,
           what="two steps in flight (sched.steps_in_flight = 2): a step may take the token "
           "of the step it follows, and an op fails"),
    Config(name="launch", model=PROTOCOL,
           defines={"NOPS": 3, "NH": 1, "STEPS": 2, "MAXFAIL": 1, "LAUNCH_AHEAD": True},
           ci=True, ci_search=False,
           what="two steps in flight, the Worker launching the next step before it reports "
           "the one before (model.launch_ahead), and an op fails"),
    Config(name="handover", model=PD, ci=True,
           what="reserve, prefill, claim: prefill death, lateness, store crash, redis restart"),
    # Larger: every interleaving of 4 ops, all faults at once on 3.
    Config(name="lanes-4", model=PROTOCOL, defines={"NOPS": 4},
           what="4 ops on 2 device and 2 host blocks"),
    Config(name="crash-4", model=PROTOCOL, defines={"NOPS": 4, "LANE_CRASHES": 1},
           what="4 ops, a lane crash"),
    Config(name="fail-4", model=PROTOCOL, defines={"NOPS": 4, "MAXFAIL": 1},
           what="4 ops, a failed op"),
    Config(name="worker-3", model=PROTOCOL, defines={"NOPS": 3, "WORKER_RESTARTS": 1},
           what="3 ops, a Worker restart"),
    Config(name="ranks-2", model=PROTOCOL, defines={"NR": 2, "NOPS": 2},
           what="2 ranks, 2 ops on 2 device and 2 host blocks"),
    Config(name="steps-worker", model=PROTOCOL,
           defines={"NOPS": 3, "STEPS": 2, "WORKER_RESTARTS": 1},
           what="two steps in flight and a Worker restart: both lost, the kept tokens with it"),
    Config(name="launch-worker", model=PROTOCOL,
           defines={"NOPS": 3, "STEPS": 2, "WORKER_RESTARTS": 1, "LAUNCH_AHEAD": True},
           what="launch ahead and a Worker restart: the step launched ahead dies with it"),
    Config(name="launch-engine", model=PROTOCOL,
           defines={"NOPS": 3, "ND": 1, "NH": 1, "STEPS": 2, "ENGINE_RESTARTS": 1,
                    "LAUNCH_AHEAD": True},
           what="launch ahead and an engine restart: a step launched ahead goes stale and fails"),
    Config(name="steps-engine", model=PROTOCOL,
           defines={"NOPS": 3, "ND": 1, "NH": 1, "STEPS": 2, "ENGINE_RESTARTS": 1},
           what="two steps in flight and an engine restart, on one block a tier"),
    Config(name="handover-live", model=PD, liveness=True,
           what="every request ends (answered or an error) under weak fairness"),
    Config(name="ranks-live", model=PROTOCOL, defines={"NR": 2, "NOPS": 2}, liveness=True,
           what="2 ranks: every op completes under weak fairness"),
    Config(name="worker-live", model=PROTOCOL, defines={"NOPS": 2, "WORKER_RESTARTS": 1},
           liveness=True, what="a Worker restart: every op completes under weak fairness"),
    Config(name="epochs", model=PROTOCOL,
           defines={"NOPS": 3, "ND": 1, "NH": 1, "WORKER_RESTARTS": 1, "ENGINE_RESTARTS": 1},
           what="a Worker and an engine restart in one run, on one block a tier"),
    # Bitstate: a partial search of configurations too large for every interleaving.
    Config(name="ranks-3", model=PROTOCOL, defines={"NR": 2, "NOPS": 3, "MAXFAIL": 1},
           bitstate=True, what="2 ranks, 3 ops, a failed op"),
    Config(name="lanes-6", model=PROTOCOL, defines={"NOPS": 6, "ND": 3, "NH": 3},
           bitstate=True, what="6 ops on 3 device and 3 host blocks"),
    Config(name="faults-3", model=PROTOCOL,
           defines={"NOPS": 3, "LANE_CRASHES": 1, "MAXFAIL": 1, "WORKER_RESTARTS": 1,
                    "ENGINE_RESTARTS": 1},
           bitstate=True, what="3 ops with every fault at once (past 20 GiB exhaustively)"),
    Config(name="engine-4", model=PROTOCOL, defines={"NOPS": 4, "ENGINE_RESTARTS": 1},
           bitstate=True, what="4 ops, an engine restart (past 6 GiB stored exhaustively)"),
    Config(name="worker-4", model=PROTOCOL, defines={"NOPS": 4, "WORKER_RESTARTS": 1},
           bitstate=True, what="4 ops, a Worker restart (past 6 GiB stored exhaustively)"),
    Config(name="handover-2", model=PD, defines={"NREQ": 2}, bitstate=True,
           what="two requests sharing the decode instance's room"),
    Config(name="faults-5", model=PROTOCOL,
           defines={"NOPS": 5, "LANE_CRASHES": 1, "MAXFAIL": 1, "WORKER_RESTARTS": 1},
           bitstate=True, what="5 ops, a lane crash, a failure and a Worker restart"),
)  # fmt: skip

MUTANTS = (
    Mutant(flag="MUT_NO_STEP_SWAP", config="lanes", caught_by=("I1", "I2", "I3"),
           what="no fence between the step and swap lanes"),
    Mutant(flag="MUT_NO_SWAP_STORE", config="lanes", caught_by=("I4",),
           what="no fence between the swap and store lanes"),
    Mutant(flag="MUT_NO_STEP_STORE", config="lanes",
           what="no fence between the step and store lanes",
           equivalent="steps touch only device blocks and store ops only host blocks: the "
           "rule never fences one on the other (they are ordered through the swap lane)"),
    Mutant(flag="MUT_NO_I3", config="i3", caught_by=("I3",),
           what="a swap-in waits on the step lane's last writer of its block, not on a step "
           "that still reads it (I3's fence removed; no configuration of 3 ops shows it)"),
    Mutant(flag="MUT_WM_EARLY", config="lanes", caught_by=("I1", "I2", "I3", "I4"),
           what="a lane advances its watermark before its copy"),
    Mutant(flag="MUT_NO_EPOCH_CHECK", config="worker", caught_by=("R",),
           what="executors never check an op's epoch"),
    Mutant(flag="MUT_CANCEL_BEFORE_EPOCH", config="worker", caught_by=("R",),
           what="a new Worker cancels its predecessor's step before writing its tier epoch"),
    Mutant(flag="MUT_LOST_AS_OK", config="restarts", caught_by=("R",),
           what="a completion lost in a lane's crash is resent as ok (the code before this "
           "model found it)"),
    Mutant(flag="MUT_NO_SPOIL", config="fail", caught_by=("R",),
           what="a failed op leaves half a copy instead of spoiling its destination"),
    Mutant(flag="MUT_NO_NAN_CHECK", config="fail", caught_by=("S",),
           what="a step computes on a spoiled block, a write-back stores one"),
    Mutant(flag="MUT_RANK0_WM", config="ranks", caught_by=("I1", "I2", "I3", "I4"),
           what="every rank waits on rank 0's watermarks"),
    Mutant(flag="MUT_FIRST_REPORT", config="ranks", caught_by=("E1", "R"),
           what="the engine counts an op complete at its first rank's report"),
    Mutant(flag="MUT_PENDING_UNCHECKED", config="steps", caught_by=("P",),
           what="the Worker runs a step on the token of a step that failed (sampled none)"),
    Mutant(flag="MUT_PENDING_UNSPOILED", config="steps", caught_by=("R",),
           what="the Worker fails a step that lacks its token without spoiling what it "
           "writes: a swap-out fenced on it copies the block's older KV as its"),
    Mutant(flag="MUT_LAUNCH_UNFENCED", config="launch", caught_by=("I1", "I3", "R"),
           what="the Worker launches the next step ahead whether or not its fence is met"),
    Mutant(flag="MUT_LAUNCH_BEHIND_UNSPOILED", config="launch", caught_by=("P", "R"),
           what="a step launched behind one whose outcome was not known yet keeps its own "
           "outcome when that one fails: it ran on a token never sampled, or on KV that was "
           "garbage before it was spoiled"),
    Mutant(flag="MUT_LAUNCH_STALE_OK", config="launch-engine",
           what="a step launched ahead whose epoch went stale before its turn is reported as "
           "it ran, its writes kept",
           equivalent="a restarted engine ignores every report of an older epoch and forgets "
           "what each block holds: it never reads what that step wrote (the code fails and "
           "spoils it all the same, so a pool under cache.poison_freed holds nothing stale)"),
    Mutant(flag="MUT_LOST_WAKEUP", config="wake",
           what="a waiter clears its doorbell after checking the watermarks (a ring in between "
           "is lost)",
           equivalent="the deadline checks the watermarks again: a lost ring costs a deadline, "
           "never a stall"),
    Mutant(flag="MUT_NO_WAIT_DEADLINE", config="wake", what="a waiter sleeps with no deadline",
           equivalent="the doorbell keeps a ring until it is taken: without lost wake-ups (and "
           "with no dead peer in this configuration) the deadline is never what wakes it"),
    Mutant(flag="MUT_LOST_WAKEUP_NO_DEADLINE", config="wake", caught_by=("invalid end state",),
           what="both at once: a lost ring and no deadline, the waiter sleeps forever"),
    Mutant(flag="MUT_DEADLINE_NO_RECHECK", config="wake", caught_by=("acceptance cycle",),
           liveness=True,
           what="at the deadline a waiter sleeps again without checking the watermarks: a "
           "cycle of deadlines that only the liveness search sees (no state is stuck)"),
    Mutant(flag="MUT_EARLY_ANSWER", config="handover", caught_by=("D2",),
           what="a prefill answers before its store watermark covers its writes"),
    Mutant(flag="MUT_TORN_WRITE", config="handover", caught_by=("D1",),
           what="a stored block is visible before it is whole, and read without its checksum"),
    Mutant(flag="MUT_NO_EXPIRY", config="handover", caught_by=("D3",),
           what="a decode instance's reservation never expires unclaimed"),
    Mutant(flag="MUT_NO_DEADLINE", config="handover", caught_by=("invalid end state",),
           what="the router waits for a prefill without a deadline"),
)  # fmt: skip


def config(name: str) -> Config:
    for c in CONFIGS:
        if c.name == name:
            return c
    raise KeyError(f"no configuration {name!r}; known: {', '.join(c.name for c in CONFIGS)}")
