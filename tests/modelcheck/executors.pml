/*
 * The executors of every rank (actors/executors): the Worker runs the step lane, two
 * Transfer lanes the swap and store lanes. Each takes its ring's ops in order, waits until
 * every other lane's watermark (of its own rank) reaches the op's fence, checks the op's
 * epoch after the wait, touches its blocks, marks it finished, advances its watermark,
 * then reports. A ring entry is removed only after the report: a crashed lane finds its
 * op again (a repeat once the watermark covers it: the completion it lost is resent).
 */

#define DI(r, g, b) (((r) * NG + (g)) * ND + (b))
#define HI(r, h) ((r) * NH + (h))
#define SI(r, key) ((r) * NK + (key))
#define KILLED(r) (wgen[r] < wkill)  /* the Worker group died; this rank has not restarted */

byte sgen[NR];  /* the device generation each rank's swap lane copies (its DeviceTier) */

/* I1-I4: every earlier op of another lane that touches a block of op k (one of them
   writing it) has finished on rank r. */
inline order_check(r, k) {
  j = 0;
  do
  :: j < k ->
     if
     :: olane[j] != olane[k] && !fin[r * NOPS + j] ->
        if
        :: (wrD[j] & rdD[k]) && olane[k] == STEP ->
           printf("I1 violated on rank %d: step op %d reads a device block swap op %d has not filled\n", r, k, j);
           assert(false)
        :: (wrD[j] & rdD[k]) && olane[k] == SWAP ->
           printf("I2 violated on rank %d: swap-out op %d reads a device block step op %d has not written\n", r, k, j);
           assert(false)
        :: (rdD[j] | wrD[j]) & wrD[k] ->
           printf("I3 violated on rank %d: op %d overwrites a device block op %d still uses\n", r, k, j);
           assert(false)
        :: (wrH[j] & (rdH[k] | wrH[k])) | (rdH[j] & wrH[k]) ->
           printf("I4 violated on rank %d: op %d and op %d touch a host block out of issue order\n", r, k, j);
           assert(false)
        :: else
        fi
     :: else
     fi; j++
  :: else -> break
  od
}

/* R: a read sees what the issue order says, or data a failed op spoiled (which whoever
   computes or stores it detects). */
inline read_check(r, k, v) {
  if
  :: v != oexp[k] && v != SPOILED ->
     printf("R violated on rank %d: op %d read identity %d, the issue order says %d\n", r, k, v, oexp[k]);
     assert(false)
  :: else
  fi
}

#ifdef MUT_NO_EPOCH_CHECK
#define STALE_WAIT(r, k) false
#else
#define STALE_WAIT(r, k) STALE(r, k)
#endif

/* Wake-ups (-DWAKEUPS): the wait as the code runs it, not one blocking guard. An
   executor checks the watermarks; if they fall short it sleeps on its own doorbell, which
   a lane rings for the other lanes of its rank after each advance (a flag: rings collapse
   into one, and the sleeper checks everything again), until it is rung or the deadline
   passes. At the deadline a stale op is cancelled and any other handed back and checked
   again (LaneExecutor.wait_fence over Actor.wait_until and the driver's msg.deferred).
   That is a cycle: while the fence is short the executor may time out forever, so `done`
   holds only if the lanes it waits on are scheduled (weak fairness). Mutants: a doorbell
   cleared after the check (a lost wake-up), no deadline, a deadline that sleeps again
   without checking. Configurations with WAKEUPS have no Worker restarts. */
#ifdef WAKEUPS
#ifdef MUT_LOST_WAKEUP_NO_DEADLINE
#define MUT_LOST_WAKEUP
#define MUT_NO_WAIT_DEADLINE
#endif
byte bell[NR * NL];
#define RING(c) bell[((c) / NL) * NL + ((c) % NL + 1) % NL] = 1; \
                bell[((c) / NL) * NL + ((c) % NL + 2) % NL] = 1
inline fence_wait(r, k, me) {
  w = 1;
  do
  :: w == 1 && FENCE_OK(r, k) -> break  /* run now */
  :: w == 1 && !FENCE_OK(r, k) ->
     w = 2;  /* to sleep */
#ifdef MUT_LOST_WAKEUP
     bell[me] = 0  /* cleared after the check: a ring in between is lost */
#else
     skip
#endif
  :: w == 2 && bell[me] -> bell[me] = 0; w = 1  /* rung: check again */
#ifndef MUT_NO_WAIT_DEADLINE
  :: w == 2 ->  /* the deadline passed */
     if
     :: STALE_WAIT(r, k) -> break
#ifdef MUT_DEADLINE_NO_RECHECK
     :: else -> skip  /* sleeps again, the watermarks unread */
#else
     :: else -> w = 1  /* handed back: checked again */
#endif
     fi
#endif
  od
}
#else
#define RING(c) skip
#endif

#ifdef MUT_NO_SPOIL
#define SPOIL GARBAGE
#else
#define SPOIL SPOILED
#endif

#ifdef LAUNCH_AHEAD
#ifdef MUT_LAUNCH_UNFENCED
#define LAUNCH_FENCE_OK(r, k) true  /* launched whether or not its fence is met */
#else
#define LAUNCH_FENCE_OK(r, k) FENCE_OK(r, k)
#endif
/* Launch ahead (-DLAUNCH_AHEAD; model.launch_ahead, actors/executors/worker.py): once step op
   k has run (its kernels queued, ``ran``), before its outcome is known, its watermark moves
   and its report goes, the Worker may run the next step op of its ring, if nothing else
   comes before it there (a Resync would), its epoch is current, its fence is met already
   (it does not wait) and its token is k's or known. It runs after k on the device (one
   stream), on what k computed: if k failed, it read k's block before k's spoiling (garbage,
   not yet NaN) and took a token k never sampled, so it fails with k. Its blocks are touched
   now (being computed); at its turn it is only collected: its result written, or spoiled if
   it failed or its epoch went stale since. Launching only after k ran ok ('late') is the
   case st == OK of this. */
inline launch_ahead(r, k) {
  k2 = k + 1;
  do
  :: k2 < NOPS && olane[k2] != STEP -> k2++
  :: else -> break
  od;
  if
  :: ran && k2 < NOPS && !KILLED(r) ->
     if
     :: ring[c]??[eval(k2)] && !(ring[c]??[RESYNC]) && !STALE(r, k2) &&
        LAUNCH_FENCE_OK(r, k2) && (opend[k2] == 0 || opend[k2] == k + 1) ->
        order_check(r, k2);
        lst = OK;
#ifndef MUT_LAUNCH_BEHIND_UNSPOILED
        if :: st != OK -> lst = FAILED :: else fi;  /* launched behind a step that failed */
#endif
        if
        :: rdD[k2] ->
           i = 0;
           do
           :: rdD[k2] & BIT(i) -> break
           :: else -> i++
           od;
           v = dev[DI(r, g, i)];
           if :: st != OK && i == odev[k] -> v = GARBAGE :: else fi;  /* k's, unspoiled yet */
           if :: lst == OK -> read_check(r, k2, v) :: else fi;  /* a failed one's is dropped */
#ifndef MUT_NO_NAN_CHECK
           if :: v == SPOILED -> lst = FAILED :: else fi
#endif
        :: else
        fi;
        if :: fails < MAXFAIL -> fails++; lst = FAILED :: skip fi;
        if
        :: lst == OK && rdD[k2] && v == SPOILED ->
           printf("S violated on rank %d: step op %d succeeded on a spoiled block\n", r, k2);
           assert(false)
        :: else
        fi;
        if
        :: lst == OK && opend[k2] != 0 && !sok[r * NOPS + opend[k2] - 1] ->
           printf("P violated on rank %d: step op %d launched ahead on the token of step op %d, which did not run ok there\n", r, k2, opend[k2] - 1);
           assert(false)
        :: else
        fi;
        dev[DI(r, g, odev[k2])] = GARBAGE;  /* being computed until its turn */
        la = k2 + 1
     :: skip  /* not launched: its frame not read yet, or the choice not to */
     fi
  :: else
  fi
}
#endif

proctype worker(byte r) {
  byte k, g, st, v, i, j, c, w;
#ifdef LAUNCH_AHEAD
  byte k2, lst, la;  /* the step op launched ahead + 1 (0: none), its status */
  bit ran;  /* the step op at hand was run (its kernels queued): one may launch behind it */
#endif
  c = r * NL + STEP;
top:
  do
  :: ring[c]?<k> ->
     if
     :: k == RESYNC -> ring[c]?k; acks!c, g  /* its WorkerReady: where it stands, its tier */
     :: k < NOPS && oseq[k] <= wm[c] -> ring[c]?k  /* done before a restart */
     :: else ->
#ifdef LAUNCH_AHEAD
        ran = 0;
        if
        :: la == k + 1 ->  /* launched ahead: its turn collects it */
           la = 0; st = lst; ran = 1;
#ifndef MUT_LAUNCH_STALE_OK
           if :: STALE(r, k) -> st = FAILED :: else fi;  /* it ran: stale since, it fails */
#endif
           if
           :: st == OK -> dev[DI(r, g, odev[k])] = k + 1
           :: else -> dev[DI(r, g, odev[k])] = SPOIL
           fi;
           goto finish
        :: else
        fi;
#endif
#ifdef WAKEUPS
        fence_wait(r, k, c);
#else
        if
        :: FENCE_OK(r, k) && !KILLED(r) -> skip
        :: STALE_WAIT(r, k) && !KILLED(r) -> skip  /* past the deadline: the op is stale */
        :: KILLED(r) -> goto restart
        :: wkill < WORKER_RESTARTS && !eng_done ->  /* this Worker dies: its group with it */
           atomic { wkill++; epoch_ctr++; wepoch = epoch_ctr }; goto restart
        fi;
#endif
#ifndef MUT_NO_EPOCH_CHECK
        if
        :: STALE(r, k) -> st = CANCELLED; goto finish
        :: else
        fi;
#endif
        order_check(r, k);
        st = OK;
#if STEPS > 1
        /* Its input is another step's token: taken from the last step it ran, if that is
           the one and it ran ok here (actors/executors/pending.py); else the step fails,
           spoiling what it writes, as a step that raises does. */
        if
        :: opend[k] != 0 && wlast[r] != opend[k] ->
#if defined(MUT_PENDING_UNCHECKED)
           skip  /* runs on a token never sampled */
#elif defined(MUT_PENDING_UNSPOILED)
           st = FAILED; goto finish  /* rejected: touches nothing */
#else
           st = FAILED
#endif
        :: else
        fi;
#endif
#ifdef LAUNCH_AHEAD
        ran = (st == OK);  /* its kernels are queued: its outcome is known only later */
#endif
        if
        :: rdD[k] && st == OK ->
           i = 0;
           do
           :: rdD[k] & BIT(i) -> break
           :: else -> i++
           od;
           v = dev[DI(r, g, i)]; read_check(r, k, v);
#ifndef MUT_NO_NAN_CHECK
           if :: v == SPOILED -> st = FAILED :: else fi  /* NaN logits: the step fails */
#endif
        :: else
        fi;
        if :: fails < MAXFAIL -> fails++; st = FAILED :: skip fi;
        dev[DI(r, g, odev[k])] = GARBAGE;  /* being computed */
        if
        :: KILLED(r) -> goto restart
        :: wkill < WORKER_RESTARTS && !eng_done ->
           atomic { wkill++; epoch_ctr++; wepoch = epoch_ctr }; goto restart
        :: !KILLED(r) -> skip
        fi;
        if
        :: st == OK && rdD[k] && v == SPOILED ->
           printf("S violated on rank %d: step op %d succeeded on a spoiled block\n", r, k);
           assert(false)
        :: else
        fi;
#if STEPS > 1
        if
        :: st == OK && opend[k] != 0 && !sok[r * NOPS + opend[k] - 1] ->
           printf("P violated on rank %d: step op %d ran on the token of step op %d, which did not run ok there\n", r, k, opend[k] - 1);
           assert(false)
        :: else
        fi;
#endif
        if
        :: st == OK -> dev[DI(r, g, odev[k])] = k + 1
        :: else -> dev[DI(r, g, odev[k])] = SPOIL  /* a failed step spoils what it wrote */
        fi;
finish:
#if STEPS > 1
        if :: st == OK -> wlast[r] = k + 1; sok[r * NOPS + k] = 1 :: else -> wlast[r] = 0 fi;
#endif
#ifdef LAUNCH_AHEAD
        launch_ahead(r, k);
#endif
        fin[r * NOPS + k] = 1; wm[c] = oseq[k]; RING(c);
        rep!k, r, st, oep[k]; ring[c]?k
     fi
  :: KILLED(r) -> goto restart
  :: eng_done && empty(ring[c]) -> break
  od;
  goto out;
restart:
  /* A new Worker process: fresh device memory, its tier epoch written before anything else,
     so that a step it cancels (advancing step_done) is seen together with the epoch. */
  wgen[r] = wkill; g = wgen[r];
#if STEPS > 1
  wlast[r] = 0;  /* a new process keeps no tokens */
#endif
#ifdef LAUNCH_AHEAD
  la = 0;  /* a step launched ahead died with the process */
#endif
#ifdef MUT_CANCEL_BEFORE_EPOCH
  do
  :: nempty(ring[c]) ->
     ring[c]?<k>;
     if
     :: k < NOPS && oep[k] < wepoch && oseq[k] > wm[c] ->
        ring[c]?k; fin[r * NOPS + k] = 1; wm[c] = oseq[k]; rep!k, r, CANCELLED, oep[k]
     :: else -> break
     fi
  :: empty(ring[c]) -> break
  od;
#endif
  tier_ep[r] = wepoch;
  wready!r, wepoch, g;
  goto top;
out:
  skip
}

proctype xfer(byte r; byte L) {
  byte k, st, v, i, j, c, dst, w;
  c = r * NL + L;
top:
  do
  :: ring[c]?<k> ->
     if
     :: k >= TIER && k < RESYNC -> ring[c]?k; sgen[r] = k - TIER
     :: k == RESYNC -> ring[c]?k; acks!c, 0
     :: k < NOPS && oseq[k] <= wm[c] ->
        /* A repeat: the completion was lost with the incarnation that did the op, and so
           was how it ended (copied, failed, or cancelled as stale): reported failed. */
#ifdef MUT_LOST_AS_OK
        if :: odir[k] == D_READ -> st = FAILED :: else -> st = OK fi;
#else
        st = FAILED;
#endif
        rep!k, r, st, oep[k]; ring[c]?k
     :: else ->
#ifdef WAKEUPS
        fence_wait(r, k, c);
#else
        if
        :: FENCE_OK(r, k) -> skip
        :: STALE_WAIT(r, k) -> skip  /* past the deadline: the op is stale */
        fi;
#endif
#ifndef MUT_NO_EPOCH_CHECK
        if
        :: STALE(r, k) -> st = CANCELLED; goto finish
        :: else
        fi;
#endif
        order_check(r, k);
#ifdef MUT_WM_EARLY
        wm[c] = oseq[k];
#endif
        st = OK;
        if :: fails < MAXFAIL -> fails++; st = FAILED :: skip fi;
        if
        :: odir[k] == D_IN ->
           v = host[HI(r, ohost[k])]; read_check(r, k, v); dst = DI(r, sgen[r], odev[k])
        :: odir[k] == D_OUT ->
           v = dev[DI(r, sgen[r], odev[k])]; read_check(r, k, v); dst = HI(r, ohost[k])
        :: odir[k] == D_WRITE ->
           v = host[HI(r, ohost[k])]; read_check(r, k, v);
#ifndef MUT_NO_NAN_CHECK
           if :: v == SPOILED -> st = FAILED :: else fi  /* a spoiled block is never stored */
#endif
        :: odir[k] == D_READ ->
           v = stor[SI(r, okey[k])];
           if
           :: v == NOTHING -> st = FAILED  /* a miss: reported missing, the block untouched */
           :: else -> read_check(r, k, v)
           fi;
           dst = HI(r, ohost[k])
        fi;
        /* A crash mid copy leaves half a copy; the next incarnation redoes the op. A
           write-back's key becomes visible only whole: a crash leaves none. */
        if
        :: crashes < LANE_CRASHES ->
           crashes++;
           if
           :: odir[k] == D_IN -> dev[dst] = GARBAGE
           :: odir[k] == D_OUT || odir[k] == D_READ -> host[dst] = GARBAGE
           :: else
           fi;
           goto top
        :: skip
        fi;
        if
        :: odir[k] == D_IN -> if :: st == OK -> dev[dst] = v :: else -> dev[dst] = SPOIL fi
        :: odir[k] == D_OUT -> if :: st == OK -> host[dst] = v :: else -> host[dst] = SPOIL fi
        :: odir[k] == D_WRITE ->
           if
           :: st == OK && (v == SPOILED || v == GARBAGE) ->
              printf("S violated on rank %d: write-back op %d stored a spoiled block\n", r, k);
              assert(false)
           :: st == OK -> stor[SI(r, okey[k])] = v
           :: else
           fi
        :: odir[k] == D_READ ->
           if
           :: st == OK -> host[dst] = v
           :: st != OK && v != NOTHING -> host[dst] = SPOIL  /* storage failed mid read */
           :: else
           fi
        fi;
finish:
        fin[r * NOPS + k] = 1; wm[c] = oseq[k]; RING(c);
        if
        :: crashes < LANE_CRASHES -> crashes++; goto top  /* dies before its report */
        :: skip
        fi;
        rep!k, r, st, oep[k]; ring[c]?k
     fi
  :: eng_done && empty(ring[c]) -> break
  od
}

init {
  byte r;
  atomic {
    r = 0;
    do
    :: r < NR -> tier_ep[r] = 1; issuer_ep[r] = 1; stor[SI(r, PRE)] = PRE; r++
    :: else -> break
    od;
    run engine();
    r = 0;
    do
    :: r < NR -> run worker(r); run xfer(r, SWAP); run xfer(r, STORE); r++
    :: else -> break
    od
  }
}

ltl done { <> eng_done }
