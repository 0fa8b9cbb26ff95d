"""Score a trained run on standard in-context tasks (multiple choice, schema, language modelling).

    python -m andrea.tasks RUN --tasks core --task-data DIR [--json tasks.json]
    python -m andrea.tasks RUN --tasks arc_easy,piqa --task-data DIR --fewshot 0 --limit 200
    andrea tasks RUN ...                              # the same
    python -m andrea.tasks RUN ... --no-shared-context   # every option's whole sequence (to time both)

RUN is a run folder, its archive/final or one checkpoint (as for `andrea generate`). --tasks takes
task names and the suites core and gauntlet (andrea/tasks/suites.py); --task-data the folder of
the JSONL files, or `hub` to read them from the Hugging Face hub through `datasets` (network).
Prints each task's accuracy and items/s as it goes, then the table; --json writes the results
(andrea/tasks/results.py). Bad input is one line on stderr and exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("path", help="run folder (results/<exp>), archive folder or step_XXXXXXXX.bin checkpoint")
    p.add_argument("--tasks", required=True, help="comma-separated task names or a suite: core, gauntlet")
    p.add_argument("--task-data", required=True, type=Path,
                   help="folder of the task files (JSONL layout), or hub: from the Hugging Face hub "
                        "(andrea/tasks/hub.py)")
    p.add_argument("--fewshot", type=int, default=None,
                   help="few-shot examples per item for every task (default: the suite's; a task alone: 0)")
    p.add_argument("--limit", type=int, default=0, help="score only the first N items of each task (0: all)")
    p.add_argument("--json", type=Path, help="write the results here (atomically)")
    p.add_argument("--backend", default="auto", choices=("auto", "numpy", "cuda"))
    p.add_argument("--precision", default="", choices=("", "fp32", "fp16", "bf16"),
                   help="compute dtype (default: fp32 on NumPy, the training precision on CUDA)")
    p.add_argument("--batch-tokens", type=int, default=0,
                   help="positions per forward pass, memory planned once (default: 65,536 on CUDA, 8,192 on NumPy)")
    p.add_argument("--tokenizer", help="tokenizer.json, or a folder holding one (default: the run's)")
    p.add_argument("--no-shared-context", dest="shared_context", action="store_false",
                   help="compute every option's whole sequence, its context included (default: the "
                        "context an item's options share once, andrea/tasks/shared.py)")
    p.set_defaults(fn=cmd_tasks)


def cmd_tasks(a, out=None) -> int:
    from ..util.atomic import atomic_write
    from .results import table
    from .hub import from_hub
    from .run import load_model, present, run_tasks
    from .suites import resolve

    if a.limit < 0:
        raise ValueError(f"--limit {a.limit}: expected 0 (all) or a positive number of items")
    if a.fewshot is not None and a.fewshot < 0:
        raise ValueError(f"--fewshot {a.fewshot}: expected 0 or more examples")
    if a.batch_tokens < 0:
        raise ValueError(f"--batch-tokens {a.batch_tokens}: expected a positive number of positions (0: the default)")
    entries, suite = resolve(a.tasks, a.fewshot)
    if not from_hub(a.task_data) and not a.task_data.is_dir():
        raise ValueError(f"--task-data {a.task_data}: no such folder; expected the folder of the task files")
    present(entries, a.task_data)  # none there: say so before loading the model
    scorer, tok, meta = load_model(a.path, a.backend, a.tokenizer, a.precision, a.batch_tokens,
                                   a.shared_context)
    res = run_tasks(scorer, tok, entries, a.task_data, a.limit, suite, meta)
    out = out or sys.stdout
    print(table(res), file=out)
    print(f"\n{res['items']:,} items in {res['wall_s']:.1f} s: {res['items_per_s']:,.1f} items/s "
          f"(backend {res['backend']}, {res['dtype']}, window {res['window']}, shared context "
          f"{'on' if res['shared_context'] else 'off'})", file=out, flush=True)
    if a.json:
        atomic_write(a.json, json.dumps(res, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    from ..run.protocol import run_command

    ap = argparse.ArgumentParser(prog="python -m andrea.tasks", description=__doc__.splitlines()[0])
    add_arguments(ap)
    a = ap.parse_args(argv)
    return run_command("andrea tasks", a.fn, a)


if __name__ == "__main__":
    sys.exit(main())
