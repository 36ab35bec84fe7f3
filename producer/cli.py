"""The `conveyor` command. Client verbs need no torch; worker verbs import it when run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor",
        description="An LLM inference worker fleet driven by Redis.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-model", help="write a small deterministic checkpoint (no model hub)")
    p.add_argument("dir", nargs="?", help="output folder (default: the data folder's models/PRESET)")
    p.add_argument("--preset", choices=["tiny", "small"], default="small")
    p.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing folder")

    p = sub.add_parser("generate", help="run prompts through the offline engine (no Redis)")
    p.add_argument("prompts", nargs="+", help="prompt texts")
    p.add_argument("--model", help="checkpoint folder (default: the small preset, made if missing)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")

    p = sub.add_parser("demo", help="make the small model if missing and show the engine at work")
    p.add_argument("--model", help="checkpoint folder (default: the small preset, made if missing)")
    p.add_argument("--requests", type=int, default=24, help="number of short questions")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Worker verbs live in worker.commands, imported only when one runs (it imports torch).
    from worker import commands

    handler = {
        "make-model": commands.make_model_cmd,
        "generate": commands.generate_cmd,
        "demo": commands.demo_cmd,
    }[args.command]
    try:
        return handler(args) or 0
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"conveyor {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
