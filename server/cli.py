"""`h2o-server` command line: serve, generate, chat, calibrate, and commands other packages
register.

Commands beyond these (`eval`, from bench/) are found through the entry-point group
`h2o_server.commands` (pyproject.toml), so this package does not import them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from config.blas import preload_openblas
from config.cache_spec import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_KVARN,
    DEFAULT_MAX_KV,
    DEFAULT_PRESET,
    DEFAULT_SCORE,
    KVARN_PRESETS,
    PRESETS,
    QUANT_GROUP_SIZES,
    SCORE_RULES,
    CacheSpec,
)
from config.policies import CALIBRATED, DEFAULT_POLICY, POLICIES

if TYPE_CHECKING:  # pydantic-settings loads only for `serve`
    from config.settings import ServerSettings

COMMAND_GROUP = "h2o_server.commands"


def _describe(table: dict) -> str:
    return "; ".join(f"{name}: {what}" for name, what in table.items())


def _add_cache_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache")
    g.add_argument("--policy", default=DEFAULT_POLICY, choices=list(POLICIES))
    g.add_argument(
        "--max-kv",
        "--h2o-max-size",
        dest="max_kv",
        type=int,
        default=None,
        help=f"cache size in tokens per layer (default: what --kv-budget allows, else "
        f"{DEFAULT_MAX_KV})",
    )
    g.add_argument(
        "--kv-budget",
        default=None,
        help="memory for this conversation's KV cache (e.g. 64MiB): max_kv is what fits",
    )
    g.add_argument(
        "--preset", default=DEFAULT_PRESET, choices=list(PRESETS), help=_describe(PRESETS)
    )
    g.add_argument(
        "--score", default=DEFAULT_SCORE, choices=list(SCORE_RULES), help=_describe(SCORE_RULES)
    )
    g.add_argument("--h2o-sink-size", "--sink", dest="sink", type=int, default=None)
    g.add_argument("--h2o-heavy-budget", "--heavy", dest="heavy", type=int, default=None)
    g.add_argument("--h2o-recent-budget", "--recent", dest="recent", type=int, default=None)
    g.add_argument(
        "--layer-budgets",
        default="auto",
        help="per-layer max_kv: auto (the shipped profile of these weights, else uniform), "
        "uniform, or a profile file from `h2o-server calibrate`; explicit segment sizes "
        "(--sink/--heavy/--recent) make it uniform",
    )
    g.add_argument(
        "--evict-batch",
        type=int,
        default=None,
        help="tokens evicted at once when the cache overflows (default max_kv/16; 1 = per step)",
    )
    g.add_argument(
        "--kv-rotate",
        dest="rotate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="h2o-q8, h2o-q4, h2o-mixed: Hadamard-rotate K/V before packing "
        "(default: on for h2o-q4's 4-bit keys)",
    )
    g.add_argument(
        "--kv-group-size",
        dest="group_size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        choices=QUANT_GROUP_SIZES,
        help="packed policies: one scale and bias per this many values",
    )
    g.add_argument(
        "--kv-dense-recent",
        dest="dense_recent",
        type=int,
        default=None,
        help="h2o-q8, h2o-q4, h2o-mixed: newest tokens also kept dense "
        "(default: 16 for h2o-q4's 4-bit keys, none for 8-bit keys)",
    )
    g.add_argument(
        "--kvarn",
        default=DEFAULT_KVARN,
        choices=list(KVARN_PRESETS),
        help="kvarn, h2o-kvarn: key and value bits",
    )


SPEC_FLAGS = (
    "preset", "score", "sink", "heavy", "recent", "evict_batch", "rotate", "group_size",
    "dense_recent", "kvarn",
)  # fmt: skip


def _cache_spec(args: argparse.Namespace, model) -> CacheSpec:
    """This conversation's CacheSpec, by the server's own function (cache.budget.fit_spec)."""
    from cache.budget import Budget, fit_spec, parse_bytes
    from models.loading import served_model_id
    from models.shape import kv_shape
    from server.engine.layer_budgets import load_layer_profile

    budget = Budget(parse_bytes(args.kv_budget), 1) if args.kv_budget else None
    max_kv = args.max_kv if args.max_kv or budget else DEFAULT_MAX_KV
    fields = {name: getattr(args, name) for name in SPEC_FLAGS}
    profile, _ = load_layer_profile(args.layer_budgets, model, served_model_id(args.model))
    shares_for = profile.shares if profile else None
    spec = fit_spec(
        kv_shape(model), budget, args.policy, max_kv=max_kv, shares_for=shares_for, **fields
    )
    # No server batcher packs a one-off run's caches later: packed from the first tile.
    return spec.replace(dense_until=0)


def _max_kv_text(spec: CacheSpec) -> str:
    """`max_kv=64`, with each layer's range when a layer profile splits it."""
    sizes = spec.layer_sizes()
    layers = f" (layers {min(sizes)}-{max(sizes)})" if sizes else ""
    return f"max_kv={spec.max_kv}{layers}"


def _stream(model, tokenizer, prompt: list[int], caches: list, args: argparse.Namespace):
    """mlx-lm's stream_generate with the command's sampling and prefill flags."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    return stream_generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        sampler=make_sampler(temp=args.temp, top_p=args.top_p),
        prompt_cache=caches,
        prefill_step_size=args.prefill_step,
    )


def _add_models_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models-dir",
        default=os.environ.get("H2O_MODELS_DIR"),
        help="the folder whose models --model may name, as serve's (default: $H2O_MODELS_DIR)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h2o-server", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion to stdout")
    gen.add_argument(
        "--model",
        default="default",
        help="'default', 'gemma3-270m', a .gguf file, a local model folder or a HF repo id; "
        "or a name `serve --models-dir` gives (a folder's model, the HF cache's org/name)",
    )
    _add_models_dir(gen)
    gen.add_argument("--prompt", required=True, help="the user message ('-' reads stdin)")
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temp", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--prefill-step", type=int, default=512, help="prompt tokens per forward pass")
    gen.add_argument("--stats", action="store_true", help="print speed and cache stats to stderr")
    _add_cache_flags(gen)

    chat = sub.add_parser(
        "chat", help="multi-turn chat in the terminal; one cache kept across turns"
    )
    chat.add_argument("--model", default="default", help="as generate's --model")
    _add_models_dir(chat)
    chat.add_argument("--system", default=None, help="system message")
    chat.add_argument("--max-tokens", type=int, default=512)
    chat.add_argument("--temp", type=float, default=0.7)
    chat.add_argument("--top-p", type=float, default=0.95)
    chat.add_argument("--prefill-step", type=int, default=512)
    _add_cache_flags(chat)

    cal = sub.add_parser(
        "calibrate",
        help="measure a layer profile (what bounding each layer's cache alone costs), or "
        "with --retention train the `learned` score rule's gates",
        description="Writes the profile `--layer-budgets PATH` reads (cache/layer_profiles.py); "
        "with --retention, the retention gates score rule `learned` finds by the model's "
        "weights (cache/retention/__init__.py, cache/retention/training.py).",
    )
    cal.add_argument("--model", default="default")
    cal.add_argument(
        "--out",
        default=None,
        help="the file to write: a profile (JSON, required), or with --retention the gates "
        "(default: ~/.cache/h2o-server/retention/<model>.safetensors, where `learned` looks)",
    )
    cal.add_argument(
        "--policy", nargs="+", default=[p.name for p in CALIBRATED], choices=list(POLICIES)
    )
    cal.add_argument(
        "--windows", type=int, default=None, help="text windows (8; --retention: 12 to train)"
    )
    cal.add_argument(
        "--tokens", type=int, default=None, help="tokens per window (512; --retention: 1024)"
    )
    cal.add_argument(
        "--retention", action="store_true", help="train retention gates for score rule learned"
    )
    cal.add_argument(
        "--text-file",
        type=Path,
        default=None,
        help="--retention: text to train on (windows from its start, then --held-out more); "
        "default: the train splits of the essays and the standard library "
        "(cache/retention/text_splits.py), "
        "the held-out windows from their select splits",
    )
    cal.add_argument("--held-out", type=int, default=4, help="--retention: held-out windows")
    cal.add_argument("--steps", type=int, default=None, help="--retention: Adam steps per layer")
    cal.add_argument("--seed", type=int, default=0, help="--retention: which query rows it reads")
    cal.add_argument(
        "--age",
        action="store_true",
        help="--retention: per-head age terms too (a log(t - i) + c (t - i) / max_kv)",
    )
    cal.add_argument(
        "--direction",
        action="store_true",
        help="--retention: the gates read each key's direction before RoPE too",
    )
    cal.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        choices=list(PRESETS),
        help="--retention: the segments its loss evicts under (serve the gates with the same)",
    )
    cal.add_argument(
        "--stride",
        type=int,
        default=16,
        help="--retention: tokens between its loss's evictions, each permanent "
        "(0: every query row chooses afresh from all middle keys)",
    )
    cal.add_argument("--max-kv", type=int, default=32, help="the bounded layer's max_kv")
    cal.add_argument("--chunk", type=int, default=16, help="tokens per forward pass")
    _add_serve_parser(sub)
    for command in entry_points(group=COMMAND_GROUP):
        command.load()(sub)  # e.g. bench.eval_cli:add_eval_parser registers `eval`
    return parser


def _add_serve_parser(sub) -> None:
    """`serve` flags mirror config.settings.ServerSettings field by field."""
    from config.settings import ServerSettings

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Every flag is also an environment variable H2O_<FLAG>, e.g. H2O_KV_BUDGET.",
    )
    for name, field in ServerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        # argparse %-formats help text: a description's "+3.6%" must reach it as "%%".
        text = field.description and field.description.replace("%", "%%")
        if name == "allowed_origins":
            serve.add_argument(flag, nargs="*", default=None, help=text)
        elif name in ("served_model_name", "models", "pin"):
            serve.add_argument(flag, nargs="+", default=None, help=text)
        elif name == "model":  # given again: the further models, served on demand
            serve.add_argument(flag, action="append", default=None, help=text)
        elif field.annotation in (bool, bool | None):  # `--kv-rotate`, `--kv-rotate false`
            serve.add_argument(flag, nargs="?", const="true", default=None, help=text)
        else:
            kind = field.annotation if field.annotation in (int, float) else str
            serve.add_argument(flag, type=kind, default=None, help=text)
    serve.add_argument(
        "--no-ui", dest="ui", action="store_const", const="false", help="same as --ui false"
    )


def cmd_generate(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from cache import make_cache
    from models.loading import load_model
    from server.engine.catalog import source_of

    model, tokenizer = load_model(source_of(args.model, args.models_dir))
    spec = _cache_spec(args, model)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.raw or not tokenizer.has_chat_template:
        prompt = tokenizer.encode(text)
    else:
        messages = [{"role": "user", "content": text}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if args.seed is not None:
        mx.random.seed(args.seed)
    caches = make_cache(model, spec)
    start, last = time.perf_counter(), None
    for last in _stream(model, tokenizer, prompt, caches, args):
        sys.stdout.write(last.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats and last is not None:
        seen, stored, mib = _cache_usage(caches)
        print(
            f"prompt {last.prompt_tokens} tok @ {last.prompt_tps:.1f} tok/s, "
            f"generated {last.generation_tokens} tok @ {last.generation_tps:.1f} tok/s, "
            f"{time.perf_counter() - start:.1f}s; "
            f"cache: {spec.policy} {_max_kv_text(spec)}, "
            f"stored {stored} of {seen} tokens, {mib:.1f} MiB, evicted {seen - stored}",
            file=sys.stderr,
        )
    return 0


def _cache_usage(caches: list) -> tuple[int, int, float]:
    """(tokens seen, tokens stored, MiB held) over a model's per-layer caches."""
    from cache import cache_usage

    seen, stored, nbytes = cache_usage(caches)
    return seen, stored, nbytes / 2**20


def cmd_chat(args: argparse.Namespace) -> int:
    """Read user turns from stdin; only the tokens past the cached history are prefilled."""
    from cache import make_cache
    from models.loading import load_model
    from server.engine.catalog import source_of

    model, tokenizer = load_model(source_of(args.model, args.models_dir))
    spec = _cache_spec(args, model)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    caches, history = make_cache(model, spec), []  # history: the tokens the caches hold
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if ids[: len(history)] != history:
            # The template rendered earlier turns differently: start over.
            caches, history = make_cache(model, spec), []
        reused, new = len(history), ids[len(history) :]
        reply, generated = "", []
        for out in _stream(model, tokenizer, new, caches, args):
            reply += out.text
            generated.append(out.token)
            print(out.text, end="", flush=True)
        print()
        # mlx-lm feeds a sampled token to the model before yielding it, except the
        # last one at max_tokens: the caches' offset says how far history reaches.
        seen, stored, mib = _cache_usage(caches)
        history = (ids + generated)[:seen]
        messages.append({"role": "assistant", "content": reply})
        print(
            f"[{spec.policy} {_max_kv_text(spec)}: {seen} tokens seen, "
            f"{stored} stored, {mib:.1f} MiB, {reused} history tokens reused]",
            file=sys.stderr,
        )


def cmd_calibrate(args: argparse.Namespace) -> int:
    import logging

    from models.loading import load_model, served_model_id
    from server.engine.layer_budgets import calibrate_profile

    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    if args.retention:
        return cmd_calibrate_retention(args)
    if args.out is None:
        raise ValueError("calibrate: --out names the profile file to write")
    model, tokenizer = load_model(args.model)
    profile = calibrate_profile(
        model, tokenizer, served_model_id(args.model), args.policy, args.windows or 8,
        args.tokens or 512, args.max_kv, args.chunk,
    )  # fmt: skip
    profile.save(args.out)
    for policy in args.policy:
        shares = [s for s in profile.shares(policy) or () if s is not None]
        print(f"{policy}: layer shares {min(shares):.2f}-{max(shares):.2f}", file=sys.stderr)
    print(args.out)
    return 0


def retention_text(args: argparse.Namespace, tokenizer) -> tuple[list, list, str]:
    """(training windows, held-out windows, what they are) for `calibrate --retention`."""
    windows, tokens = args.windows or 12, args.tokens or 1024
    if args.text_file is not None:
        ids = tokenizer.encode(args.text_file.read_text(), add_special_tokens=False)
        needed = (windows + args.held_out) * tokens
        if len(ids) < needed:
            raise ValueError(f"{args.text_file}: {len(ids)} tokens, {needed} needed")
        cut = [ids[i * tokens : (i + 1) * tokens] for i in range(windows + args.held_out)]
        return cut[:windows], cut[windows:], f"{args.text_file.name}: windows from its start"
    from cache.retention.text_splits import CORPORA, split_windows

    train, held = [], []
    for n, corpus in enumerate(CORPORA):  # half of each from each kind of text
        share = windows // len(CORPORA) + (n < windows % len(CORPORA))
        held_share = args.held_out // len(CORPORA) + (n < args.held_out % len(CORPORA))
        train += split_windows(tokenizer, corpus, "train", share, tokens)
        if held_share:
            held += split_windows(tokenizer, corpus, "select", held_share, tokens)
    return (
        train,
        held,
        "cache/retention/text_splits.py: essays + code, train split (held out: select split)",
    )


def cmd_calibrate_retention(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from cache.retention import USER, forget
    from cache.retention.training import TrainConfig, train_retention
    from models.loading import load_model, served_model_id

    model, tokenizer = load_model(args.model)
    train, held, text = retention_text(args, tokenizer)
    config = TrainConfig(
        seed=args.seed,
        age=args.age,
        direction=args.direction,
        preset=args.preset,
        stride=args.stride,
        **({"steps": args.steps} if args.steps else {}),
    )
    bar = tqdm(total=1, unit="step", file=sys.stderr, dynamic_ncols=True)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.set_description("recording" if done <= len(train) + len(held) else "fitting layers")
        bar.update(done - bar.n)

    name = served_model_id(args.model)
    retention = train_retention(model, train, held, name, config, text, progress)
    bar.close()
    out = Path(args.out) if args.out else USER / f"{Path(name).name}.safetensors"
    retention.save(out)
    forget(model)
    loss = retention.training["held_out_loss"]
    print(
        f"retention gates for {name}: {len(train)} windows of {len(train[0])} tokens, "
        f"{retention.training['seconds']:.0f} s; held-out loss {loss} of mean's 1.0 "
        f"({len(held)} windows: each layer's attention output change under eviction)",
        file=sys.stderr,
    )
    print(out)
    return 0


def serve_settings(args: argparse.Namespace) -> ServerSettings:
    """ServerSettings from `serve`'s flags, which override H2O_* environment variables,
    which override the defaults (pydantic's ValidationError on a bad value)."""
    from config.settings import ServerSettings

    given = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    if "model" in given:
        first, *more = given["model"]
        given["model"] = first
        if more:
            given["models"] = more + given.get("models", [])
    return ServerSettings(**given)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from server.api.lifecycle import serve

    settings = serve_settings(args)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    serve(settings)
    return 0


def main(argv: list[str] | None = None) -> int:
    preload_openblas()  # before anything imports MLX
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "chat":
            return cmd_chat(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "calibrate":
            return cmd_calibrate(args)
        if args.command == "eval":
            return args.run_eval(args)
    except ValidationError as e:
        reasons = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        print(f"h2o-server: invalid settings: {reasons}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad model name, bad budget split, ...
        print(f"h2o-server: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
