"""lm-eval (``lm_eval.simple_evaluate``, the code path of ``lm_eval --model local-completions``)
scores two tasks written here against ``ringfence serve`` of SmolLM2 as its ``hf`` model
scores them on transformers' float32 load of the same GGUF file.

The tasks, their YAML and their JSONL data live in tmp_path (``dataset_path: json``, no hub:
``HF_DATASETS_OFFLINE`` and ``HF_HUB_OFFLINE`` are set): a 4-way multiple choice on six
capitals (``loglikelihood``: one ``/v1/completions`` per choice, token ids, ``echo``,
``logprobs: 1``, ``max_tokens: 1``; lm-eval sums ``token_logprobs[ctxlen:-1]``) and a
``generate_until`` completion of the same six (greedy, stop strings, token-id prompts).
Per document and choice the log-likelihood equals hf's within ``TOLERANCE`` and the
greedy flag is the same; accuracy and exact match are equal; generated texts are equal.
Then once more with ``tokenizer_backend=remote`` on the first ``REMOTE_DOCS`` documents of
each task: lm-eval reads ``/tokenizer_info`` and ``/tokenize`` from the server instead of a
local tokenizer, and must score them the same. ``RemoteTokenizer`` itself (``/detokenize``
too, which lm-eval uses where requests go as text) is checked against transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from client_runs import require_answer, served_model
from hf_reference import reference_dir
from serving import Server

pytest.importorskip("lm_eval", reason="the client under test (the test extra installs lm-eval)")
pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")

# Per continuation (one to three tokens), in nats. Float32 logits of the two stacks agree
# within 3e-4 (test_gguf.py, measured 7.3e-5); a token's log-probability differs by at most
# twice its logit's difference, summed over the continuation's tokens. Measured: 3.0e-5.
TOLERANCE = 5e-4
REMOTE_DOCS = 2  # the remote-tokenizer run scores the first two documents of each task
MC_TASK, GEN_TASK = "rf_capitals_mc", "rf_capitals_gen"
CAPITALS = (
    ("France", "Paris", ("Paris", "Lyon", "Marseille", "Nice")),
    ("Japan", "Tokyo", ("Osaka", "Tokyo", "Kyoto", "Nagoya")),
    ("Italy", "Rome", ("Milan", "Naples", "Rome", "Turin")),
    ("Canada", "Ottawa", ("Toronto", "Ottawa", "Vancouver", "Montreal")),
)
SHOTS = "The capital of Peru is Lima.\\nThe capital of Kenya is Nairobi.\\n"  # YAML-escaped
MC_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{shots}The capital of {{{{country}}}} is"
doc_to_target: "{{{{capital}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_punctuation: true
    regexes_to_ignore: [" "]
"""


def write_tasks(directory: Path) -> Path:
    """The two tasks' JSONL data and YAML files in ``directory``; the folder lm-eval's
    ``TaskManager(include_path=...)`` reads."""
    rows = [
        {"country": country, "capital": capital, "choices": list(choices),
         "answer": choices.index(capital)}
        for country, capital, choices in CAPITALS
    ]  # fmt: skip
    data = directory / "capitals.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / f"{MC_TASK}.yaml").write_text(MC_YAML.format(task=MC_TASK, data=data))
    (directory / f"{GEN_TASK}.yaml").write_text(
        GEN_YAML.format(task=GEN_TASK, data=data, shots=SHOTS)
    )
    return directory


@pytest.fixture(scope="module")
def evaluate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``simple_evaluate`` of lm-eval on the two tasks (offline, caches in tmp), by model
    name and arguments: its result dict."""
    tmp = tmp_path_factory.mktemp("lm-eval")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_CACHE", str(tmp / "datasets-cache"))
        env.setenv("TOKENIZERS_PARALLELISM", "false")
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        tasks = TaskManager(include_path=str(write_tasks(tmp)), include_defaults=False)

        def run(lm: str, /, limit: int | None = None, **model_args: Any) -> dict[str, Any]:
            results = simple_evaluate(
                limit=limit,
                model=lm,
                model_args=model_args,
                tasks=[MC_TASK, GEN_TASK],
                task_manager=tasks,
                log_samples=True,
                bootstrap_iters=0,
                random_seed=0,
            )
            assert results is not None
            return dict(results)

        yield run


@pytest.fixture(scope="module")
def hf_results(evaluate: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """lm-eval's ``hf`` model: transformers' float32 load of the GGUF file (saved once per
    session, ``tests/hf_reference.py``), batch 1."""
    return evaluate(  # type: ignore[no-any-return]
        "hf", pretrained=str(reference_dir(tmp_path_factory)), dtype="float32", device="cpu",
        batch_size=1,
    )  # fmt: skip


def completions_args(server: Server, **more: Any) -> dict[str, Any]:
    """``local-completions``' model arguments for ``server``: no retries (a refusal fails
    at once) and one request at a time."""
    return {
        "model": served_model(server),
        "base_url": f"{server.url}/v1/completions",
        "num_concurrent": 1,
        "max_retries": 1,
        "timeout": 120,
        **more,
    }


def loglikelihood_body(server: Server, tokenizer_dir: Path) -> dict[str, Any]:
    """The body lm-eval's local-completions sends for one ``loglikelihood`` request
    (``LocalCompletionsAPI._create_payload(generate=False)``): context and continuation as
    one list of token ids in a batch of one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids = tokenizer("Question: What is the capital of France?\nAnswer: Paris").input_ids
    return {
        "model": served_model(server),
        "prompt": [ids],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }


def require_loglikelihoods(server: Server, tokenizer_dir: Path) -> Any:
    """The server's answer to :func:`loglikelihood_body`; a failure naming what it lacks."""
    return require_answer(
        server, "POST", "/v1/completions", loglikelihood_body(server, tokenizer_dir),
        "lm-eval's loglikelihood request needs echo and logprobs in /v1/completions",
    )  # fmt: skip


@pytest.fixture(scope="module")
def served_results(evaluate: Any, smollm2_server: Server, tokenizer_dir: Path) -> dict[str, Any]:
    """local-completions with the checkpoint's tokenizer (``tokenizer_backend=huggingface``)."""
    require_loglikelihoods(smollm2_server, tokenizer_dir)
    return evaluate(  # type: ignore[no-any-return]
        "local-completions",
        **completions_args(
            smollm2_server, tokenizer=str(tokenizer_dir), tokenizer_backend="huggingface"
        ),
    )


@pytest.fixture(scope="module")
def remote_results(evaluate: Any, smollm2_server: Server, tokenizer_dir: Path) -> dict[str, Any]:
    """local-completions with ``tokenizer_backend=remote``: no local tokenizer at all."""
    require_loglikelihoods(smollm2_server, tokenizer_dir)
    require_answer(
        smollm2_server, "GET", "/tokenizer_info", None,
        "lm-eval's remote tokenizer reads GET /tokenizer_info",
    )  # fmt: skip
    return evaluate(  # type: ignore[no-any-return]
        "local-completions",
        limit=REMOTE_DOCS,
        **completions_args(smollm2_server, tokenizer_backend="remote"),
    )


def likelihoods(results: dict[str, Any]) -> dict[tuple[int, int], tuple[float, bool]]:
    """(doc id, choice index) -> (log-likelihood, is greedy) of the multiple-choice task."""
    out = {}
    for sample in results["samples"][MC_TASK]:
        for choice, response in enumerate(sample["resps"]):
            loglikelihood, greedy = response[0]
            out[sample["doc_id"], choice] = (float(loglikelihood), bool(greedy))
    return out


def generations(results: dict[str, Any]) -> dict[int, str]:
    """doc id -> the generated text of the generation task."""
    return {s["doc_id"]: s["resps"][0][0] for s in results["samples"][GEN_TASK]}


def doc_metrics(results: dict[str, Any]) -> dict[tuple[str, int], float]:
    """(metric, doc id) -> that document's score: acc and acc_norm, exact_match."""
    out = {}
    for task, names in ((MC_TASK, ("acc", "acc_norm")), (GEN_TASK, ("exact_match",))):
        for sample in results["samples"][task]:
            out.update({(name, sample["doc_id"]): float(sample[name]) for name in names})
    return out


def metrics(results: dict[str, Any]) -> dict[str, float]:
    return {
        "acc": results["results"][MC_TASK]["acc,none"],
        "acc_norm": results["results"][MC_TASK]["acc_norm,none"],
        "exact_match": results["results"][GEN_TASK]["exact_match,none"],
    }


def assert_same_scores(got: dict[str, Any], expected: dict[str, Any], docs: int) -> None:
    """On the first ``docs`` documents of each task: per choice within TOLERANCE with the
    same greedy flags, the same generated texts, the same score per document."""
    ours, theirs = likelihoods(got), likelihoods(expected)
    assert sorted(ours) == [(doc, choice) for doc in range(docs) for choice in range(4)]
    diffs = {key: abs(ours[key][0] - theirs[key][0]) for key in ours}
    worst = max(diffs, key=diffs.__getitem__)
    print(f"largest log-likelihood difference {diffs[worst]:.2e} at (doc, choice) {worst}")
    for key in sorted(ours):
        print(f"  {key}: {ours[key][0]:.6f} vs {theirs[key][0]:.6f}")
    assert diffs[worst] <= TOLERANCE, (worst, ours[worst], theirs[worst])
    assert {k: v[1] for k, v in ours.items()} == {k: theirs[k][1] for k in ours}
    texts = generations(got)
    assert sorted(texts) == list(range(docs))
    assert texts == {doc: generations(expected)[doc] for doc in texts}
    scores = doc_metrics(got)
    assert scores == {key: doc_metrics(expected)[key] for key in scores}
    print(f"metrics {metrics(got)}; generations {texts}")


def test_lm_evals_loglikelihood_request_is_answered_as_it_reads_it(
    smollm2_server: Server, tokenizer_dir: Path
) -> None:
    """echo + logprobs 1 + max_tokens 1 over token ids: one logprob per prompt token (the
    first null) and one for the generated token, each with its top alternatives, as
    ``LocalCompletionsAPI.parse_logprobs`` slices them."""
    body = loglikelihood_body(smollm2_server, tokenizer_dir)
    answer = require_loglikelihoods(smollm2_server, tokenizer_dir)
    (choice,) = answer["choices"]
    logprobs = choice["logprobs"]
    count = len(body["prompt"][0]) + 1
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == count
    assert len(logprobs["top_logprobs"]) == count
    assert logprobs["token_logprobs"][0] is None
    assert all(isinstance(x, float) for x in logprobs["token_logprobs"][1:])
    for top in logprobs["top_logprobs"][1:]:
        assert 1 <= len(top) <= 2  # the top one, and the prompt's token if another


def test_multiple_choice_and_generation_score_as_lm_evals_hf_model(
    served_results: dict[str, Any], hf_results: dict[str, Any]
) -> None:
    assert_same_scores(served_results, hf_results, docs=len(CAPITALS))
    assert metrics(served_results) == metrics(hf_results)


def test_the_remote_tokenizer_backend_scores_the_same(
    remote_results: dict[str, Any], hf_results: dict[str, Any]
) -> None:
    assert_same_scores(remote_results, hf_results, docs=REMOTE_DOCS)


def test_lm_evals_remote_tokenizer_reads_the_checkpoints_tokenizer(
    smollm2_server: Server, tokenizer_dir: Path
) -> None:
    """``RemoteTokenizer`` (``/tokenizer_info``, ``/tokenize``, ``/detokenize``) encodes,
    decodes, names its special tokens and renders the chat template as transformers does."""
    from lm_eval.utils import RemoteTokenizer
    from transformers import AutoTokenizer

    require_answer(
        smollm2_server, "GET", "/tokenizer_info", None,
        "lm-eval's remote tokenizer reads GET /tokenizer_info",
    )  # fmt: skip
    remote = RemoteTokenizer(f"{smollm2_server.url}/v1/completions", timeout=30)
    local = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    text = "Question: What is the capital of France?\nAnswer: Paris <|im_end|>"
    ids = local(text, add_special_tokens=False).input_ids
    assert remote.encode(text) == ids
    assert remote.decode(ids) == local.decode(ids), (
        "/detokenize must keep special tokens: lm-eval decodes token ids to send text and "
        "assumes the round trip is lossless (transformers' decode keeps them by default)"
    )
    assert (remote.eos_token, remote.eos_token_id) == (local.eos_token, local.eos_token_id)
    assert (remote.bos_token, remote.bos_token_id) == (local.bos_token, local.bos_token_id)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert remote.apply_chat_template(chat) == local.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
