"""lm-eval (EleutherAI's lm-evaluation-harness) scores wkvm through its server, and gets the loglikelihoods that the
same harness gets from the Python API and that BlinkDL's `rwkv` package computes: an outside check of `echo`,
`logprobs` and prompt logprobs on /v1/completions.

Three runs of one local task (no dataset download: N items cut from data/tinyshakespeare.txt, a few lines of
context and the next line as the continuation, written as JSONL plus a task YAML in a temporary folder):
  server  lm-eval's own `local-completions` model against `wkvm serve` on loopback (token-id prompts in batches,
          `echo` + `logprobs: 1` + `max_tokens: 1`), tokenizer: the model's tokenizer.json through transformers;
  python  the harness over `wkvm.LLM` (`SamplingParams(max_tokens=0, prompt_logprobs=1)`), wkvm's own tokenizer;
  rwkv    the harness over the `rwkv` package (RWKV_V7_ON=1, strategy cpu fp32) on a .pth copy of the model.
Every item's loglikelihood must agree within --tol (1e-4) across the three, and so must is_greedy.

    .venv/bin/python scripts/lm_eval_check.py [--items 300] [--json out.json]

Needs the `eval` extra: `pip install -c constraints.txt -e '.[eval]'`. Exits 1 when an item differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # nothing from a hub, ever
    os.environ[var] = "1"
os.environ["RWKV_V7_ON"] = "1"  # read by the `rwkv` package at import
os.environ.setdefault("RWKV_CUDA_ON", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from wkvm import LLM, SamplingParams  # noqa: E402
from wkvm.config import ServerConfig  # noqa: E402
from wkvm.models.rwkv7.checkpoint import convert  # noqa: E402
from wkvm.server.background import BackgroundServer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "data" / "tinyshakespeare.txt"
EMBEDDED = ROOT / "wkvm" / "assets" / "wkvm-tiny-shakespeare"
TASK = "wkvm_shakespeare_next_line"
CONTEXT_LINES = 3
CHOICES = 4  # the true next line and three lines from elsewhere in the play
# Scores: token ids of each request (context + continuation) and its context length -> (loglikelihood, is_greedy)
Scores = Callable[[list[list[int]], list[int]], list[tuple[float, bool]]]


def shakespeare_items(path: Path, n: int) -> list[dict[str, Any]]:
    """n items spread over the text: CONTEXT_LINES lines of one speech, then CHOICES candidate next lines, the true
    one (at index `gold`, cycling) and the true next lines of the following items."""
    lines = path.read_text(encoding="utf-8").split("\n")
    spans = [i for i in range(CONTEXT_LINES, len(lines)) if all(x.strip() for x in lines[i - CONTEXT_LINES : i + 1])]
    if len(spans) < n:
        raise SystemExit(f"{path} has only {len(spans)} usable items; ask for fewer")
    picked = [spans[k * len(spans) // n] for k in range(n)]
    items = []
    for k, i in enumerate(picked):
        others = [lines[picked[(k + j) % n]] for j in range(1, CHOICES)]
        gold = k % CHOICES
        items.append({"context": "\n".join(lines[i - CONTEXT_LINES : i]) + "\n", "gold": gold,
                      "choices": [*others[:gold], lines[i], *others[gold:]]})  # fmt: skip
    return items


def write_task(folder: Path, items: list[dict[str, Any]]) -> None:
    """The task as lm-eval reads it: a JSONL dataset (HF `json` builder, a local file) and its YAML."""
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items), encoding="utf-8")
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
  cache_dir: {json.dumps(str(folder / "datasets-cache"))}
test_split: test
num_fewshot: 0
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def write_hf_tokenizer(model: Path, folder: Path) -> Path:
    """The model's tokenizer.json as a transformers tokenizer folder (lm-eval loads its tokenizer that way)."""
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


class ScoringLM(TemplateLM):
    """lm-eval's model interface over a scoring function: the harness tokenizes and splits context from
    continuation (TemplateLM), `scores` gives each request's loglikelihood and is_greedy."""

    def __init__(self, encode: Callable[[str], list[int]], eot: int, scores: Scores):
        super().__init__()
        self.encode, self.eot, self.scores = encode, eot, scores

    @property
    def eot_token_id(self) -> int:
        return self.eot

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.encode(string)

    def _loglikelihood_tokens(self, requests: list[Any], **kwargs: Any) -> list[tuple[float, bool]]:
        return self.scores([ctx + cont for _, ctx, cont in requests], [len(ctx) for _, ctx, _ in requests])

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("this check scores loglikelihood tasks only")

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError("this check scores loglikelihood tasks only")


def wkvm_scores(llm: LLM) -> Scores:
    def scores(seqs: list[list[int]], ctxlens: list[int]) -> list[tuple[float, bool]]:
        outs = llm.generate(seqs, SamplingParams(max_tokens=0, prompt_logprobs=1))
        res = []
        for out, ids, c in zip(outs, seqs, ctxlens, strict=True):
            assert out.prompt_logprobs is not None
            lps = [d for d in out.prompt_logprobs[c:] if d is not None]  # c >= 1: the first token is context
            res.append((sum(d[t] for d, t in zip(lps, ids[c:], strict=True)),
                        all(d[t] == max(d.values()) for d, t in zip(lps, ids[c:], strict=True))))  # fmt: skip
        return res

    return scores


def rwkv_scores(pth: Path) -> Scores:
    from rwkv.model import RWKV

    ref = RWKV(str(pth).removesuffix(".pth"), "cpu fp32")

    def scores(seqs: list[list[int]], ctxlens: list[int]) -> list[tuple[float, bool]]:
        res = []
        for ids, c in zip(seqs, ctxlens, strict=True):
            logits, _ = ref.forward(ids, None, full_output=True)
            lp = torch.log_softmax(logits.float(), -1)[c - 1 : -1]
            want = torch.tensor(ids[c:])
            res.append((float(lp.gather(-1, want.unsqueeze(-1)).sum()), bool((lp.argmax(-1) == want).all())))
        return res

    return scores


def evaluate(model: Any, tasks: TaskManager, model_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One harness run of the task: (loglikelihood, is_greedy) per (document, choice), and its accuracy."""
    t0 = time.perf_counter()
    out = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True, task_manager=tasks,
                          bootstrap_iters=0, verbosity="WARNING")  # fmt: skip
    assert out is not None
    scores = {(s["doc_id"], j): (float(r[0][0]), bool(r[0][1]))
              for s in out["samples"][TASK] for j, r in enumerate(s["resps"])}  # fmt: skip
    return {"scores": scores, "acc": out["results"][TASK]["acc,none"], "seconds": time.perf_counter() - t0}


def run_check(items: int = 300, model: Path = EMBEDDED, text: Path = TEXT, batch_size: int = 16) -> dict[str, Any]:
    """The three runs and the largest difference between any two of them over every (document, choice)."""
    with tempfile.TemporaryDirectory(prefix="wkvm-lm-eval-") as tmp:
        folder = Path(tmp)
        write_task(folder, shakespeare_items(text, items))
        tasks = TaskManager(include_path=str(folder), include_defaults=False)  # not lm-eval's thousands of tasks
        tokenizer = write_hf_tokenizer(model, folder / "tokenizer")
        pth = folder / "model.pth"
        convert(model, pth)  # the `rwkv` package reads BlinkDL's .pth
        runs: dict[str, dict[str, Any]] = {}
        with BackgroundServer(ServerConfig(model=str(model))) as server:
            args = {"base_url": f"{server.url}/v1/completions", "model": server.ctx.model_name,
                    "tokenizer": str(tokenizer), "tokenizer_backend": "huggingface", "tokenized_requests": True,
                    "batch_size": batch_size, "max_retries": 1}  # fmt: skip
            runs["server"] = evaluate("local-completions", tasks, args)
        llm = LLM(model)
        encode, eot = llm.tokenizer.encode, llm.tokenizer.eos_token_id
        runs["python"] = evaluate(ScoringLM(encode, eot, wkvm_scores(llm)), tasks)
        runs["rwkv"] = evaluate(ScoringLM(encode, eot, rwkv_scores(pth)), tasks)
    report: dict[str, Any] = {"model": str(model), "items": items, "loglikelihoods": len(runs["server"]["scores"]),
                              "runs": {name: {"acc": r["acc"], "seconds": round(r["seconds"], 2)}
                                       for name, r in runs.items()}}  # fmt: skip
    for a, b in (("server", "python"), ("server", "rwkv"), ("python", "rwkv")):
        sa, sb = runs[a]["scores"], runs[b]["scores"]
        assert sa.keys() == sb.keys() and len(sa) == items * CHOICES, f"{a} and {b} scored different requests"
        report[f"max_abs_diff_{a}_{b}"] = max(abs(sa[key][0] - sb[key][0]) for key in sa)
        report[f"greedy_mismatches_{a}_{b}"] = sum(sa[key][1] != sb[key][1] for key in sa)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--items", type=int, default=300, help="items in the task (default 300)")
    p.add_argument("--model", type=Path, default=EMBEDDED, help="an RWKV-7 model (default: the embedded one)")
    p.add_argument("--text", type=Path, default=TEXT, help="the text the items are cut from")
    p.add_argument("--tol", type=float, default=1e-4, help="largest allowed |loglikelihood difference|")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: a tiny model gains nothing from more)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    report = run_check(args.items, args.model, args.text)
    print(f"lm-eval task {TASK}: {report['items']} items x {CHOICES} choices = {report['loglikelihoods']} "
          f"loglikelihoods, model {report['model']}")  # fmt: skip
    print(f"{'run':<8} {'acc':>8} {'seconds':>8}")
    for name, run in report["runs"].items():
        print(f"{name:<8} {run['acc']:>8.4f} {run['seconds']:>8.1f}")
    ok = True
    for key in [k for k in report if k.startswith("max_abs_diff_")]:
        pair = key.removeprefix("max_abs_diff_")
        bad = report[key] > args.tol or report[f"greedy_mismatches_{pair}"]
        ok &= not bad
        print(f"max |d loglikelihood| {pair.replace('_', ' vs '):<17} {report[key]:.2e}  "
              f"is_greedy mismatches {report[f'greedy_mismatches_{pair}']}  {'FAIL' if bad else 'ok'}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
