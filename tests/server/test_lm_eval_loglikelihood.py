"""lm-evaluation-harness's `local-completions` model runs a loglikelihood (multiple-choice) task
against a live server (the engine core process, as `hybridserve serve` runs it): every
loglikelihood it reports equals the one computed directly with transformers on the same
checkpoint and tokens. The task and its documents are local files; nothing is downloaded."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.config import EngineConfig
from hybridserve.engine.core_client import EngineCoreClient
from hybridserve.models.tokenizer import Tokenizer
from hybridserve.server.app import build_app
from tests.helpers.checkpoints import reference_text_model
from tests.helpers.live_server import ServerThread, tiny_config

MODEL = "tiny"
TASK = "hybridserve_tiny_loglikelihood"
ATOL = 1e-3  # a sum of up to a few dozen logprobs, each within 1e-4 of transformers' on CPU

# lm-eval is the `eval` extra, not a test dependency (it pulls pandas, pyarrow, scipy, scikit-learn):
# without it this module is skipped; it is imported in the test, after the environment keeps it offline.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval")]

DOCS = [
    {"question": "The cat sat on the", "choices": ["mat", "moon", "quiet garden wall"], "answer": 0},
    {"question": "Hybrid models interleave attention with", "choices": ["linear layers", "soup"], "answer": 0},
    {"question": "A snapshot is taken at a token", "choices": ["boundary", "party", "ocean floor"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
]


def write_task(directory: Path) -> None:
    """A multiple-choice task over a local JSON-lines file: one loglikelihood request per choice
    (lm-eval puts its target delimiter, a space, between the question and each choice)."""
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")


@pytest.fixture(scope="module")
def server(text_checkpoint: Path) -> Iterator[ServerThread]:
    base = tiny_config(max_num_batched_tokens=16)  # chunked prefill
    config = EngineConfig(model=str(text_checkpoint), device=base.device, dtype=base.dtype, cache=base.cache,
                          scheduler=base.scheduler)
    core = EngineCoreClient(config, max_waiting_requests=64)
    core.start()
    try:
        with ServerThread(build_app(core, model_name=MODEL), core) as srv:
            yield srv
    finally:
        core.shutdown()


@torch.no_grad()
def direct_loglikelihood(model: torch.nn.Module, tokenizer: Tokenizer, context: str,
                         continuation: str) -> tuple[float, bool]:
    """The continuation's log-probability given the context (tokens split as lm-eval splits them:
    the whole text encoded, the context's own encoding length cut off), and whether it is greedy."""
    whole = tokenizer.encode(context + continuation)
    context_len = len(tokenizer.encode(context))
    logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    rows = logprobs[context_len - 1:len(whole) - 1]
    targets = torch.tensor(whole[context_len:])
    chosen = rows.gather(1, targets[:, None])[:, 0]
    return float(chosen.sum()), bool((rows.argmax(dim=-1) == targets).all())


def test_lm_eval_local_completions_loglikelihood(server: ServerThread, text_checkpoint: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_CACHE", str(tmp_path / "datasets")), ("OPENAI_API_KEY", "unused")):
        monkeypatch.setenv(name, value)
    import lm_eval
    from lm_eval.tasks import TaskManager

    write_task(tmp_path)
    results: dict[str, Any] = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{server.url}/v1/completions", "model": MODEL, "tokenizer": str(text_checkpoint),
                    "tokenizer_backend": "huggingface", "batch_size": 3, "max_retries": 1},
        tasks=[TASK], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True, use_cache=None, random_seed=0)
    samples = results["samples"][TASK]
    assert len(samples) == len(DOCS)
    reference, tokenizer = reference_text_model(text_checkpoint), Tokenizer.from_model_dir(text_checkpoint)
    checked = 0
    for sample in samples:
        for arguments, response in zip(sample["arguments"], sample["resps"]):
            context, continuation = arguments[0], arguments[1]
            loglikelihood, greedy = response[0]
            want, want_greedy = direct_loglikelihood(reference, tokenizer, context, continuation)
            assert abs(loglikelihood - want) <= ATOL, (context, continuation, loglikelihood, want)
            assert greedy == want_greedy
            checked += 1
    assert checked == sum(len(doc["choices"]) for doc in DOCS)
    assert 0.0 <= results["results"][TASK]["acc,none"] <= 1.0
