"""The `workbench` command: run, generate, info, parity (and the other surfaces' entry points)."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from workbench.errors import WorkbenchError, clip
from workbench.messages import check_messages, conversation


def _model_args(parser: argparse.ArgumentParser) -> None:
    _model_source_args(parser)
    _device_args(parser)
    _numerics_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _model_source_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face checkpoint dir (default: embedded SmolLM2-135M)")
    parser.add_argument("--quantize", default=None,
                        help="quantize a float checkpoint on load: a format for every matrix (Q8_0, Q4_K, ...) "
                        "or llama.cpp's mix (Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M)")


def _device_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--devices", default=None, type=_device_list,
                        help="split the layers over several devices, comma-separated (cuda:0,cuda:1): contiguous "
                        "ranges sized by each device's free memory")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="activation dtype")


def _numerics_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numerics", default="exact", choices=["exact", "llamacpp"],
                        help="what quantized matmuls compute: exact floats, or llama.cpp's Q8 activations and integer dots")


def _load(args: argparse.Namespace):
    import workbench

    return workbench.load(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize,
                          devices=args.devices)


def _reduction(text: str) -> str | int | None:
    """``--reduce``: none (every token's row, ``None`` to the API), last, mean, or a position."""
    if text in ("none", "last", "mean"):
        return None if text == "none" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give none, last, mean or a position, not {text!r}") from None


def _device_list(text: str) -> list[str]:
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise argparse.ArgumentTypeError("give devices separated by commas, such as cuda:0,cuda:1")
    return devices


def _port(text: str) -> int:
    """A TCP port, checked before any model loads."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 1 to 65535, not {text!r}")
    return port


def next_token_distribution(model, ids: list[int], top_k: int, logits=None) -> dict[str, Any]:
    """The next-token top-k of a prompt, with token text and log-probabilities (JSON-ready); ``logits`` are the
    prompt's last row when already computed."""
    from workbench.results import top_k as most_likely

    last = model.forward(ids)[-1] if logits is None else logits
    top = most_likely(last, top_k, model)
    return {"tokens": model.token_texts(ids), "ids": ids, "top_k": [t.to_dict() for t in top]}


def read_prompts(path: str) -> list[str]:
    """One prompt per non-empty line of a UTF-8 text file (``-``: standard input)."""
    return [prompt for _, prompt in read_numbered_prompts(path)]


def read_numbered_prompts(path: str) -> list[tuple[int, str]]:
    """``(line number from 1, prompt)`` of each non-empty line of a UTF-8 text file (``-``: standard input). Lines
    end at ``\n`` (a ``\r`` before it is dropped) alone: a form feed or U+2028 inside a prompt is part of it."""
    try:
        # bytes decoded here: text-mode reading would also end lines at a lone \r
        text = (sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()).decode("utf-8")
    except FileNotFoundError:
        raise WorkbenchError(f"prompt file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise WorkbenchError(f"cannot read prompts from {path}: {err.__class__.__name__}: {err}") from None
    lines = text.split("\n")
    prompts = [(n, line.removesuffix("\r")) for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise WorkbenchError(f"{path} holds no prompts (one a line)")
    return prompts


def read_messages(path: str) -> list[dict[str, str]]:
    """A conversation from a UTF-8 JSON file (``-``: standard input): a list of ``{"role", "content"}`` messages."""
    try:
        text = (sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()).decode("utf-8")
        return check_messages(json.loads(text))
    except FileNotFoundError:
        raise WorkbenchError(f"messages file not found: {path}") from None
    except WorkbenchError as err:
        raise WorkbenchError(f"{path}: {err}") from None
    except (OSError, ValueError, RecursionError) as err:  # bad UTF-8 or JSON, a number JSON cannot convert
        raise WorkbenchError(f"cannot read messages from {path}: {err.__class__.__name__}: {clip(str(err), 200)}"
                             ) from None


def command_line_prompt(args: argparse.Namespace, text: str | None) -> str | list[dict[str, str]]:
    """The prompt a command line gives: ``--messages``'s conversation, or the text (after ``--system`` as one user
    message, when given)."""
    if args.messages is not None:
        if text is not None or args.system is not None:
            raise WorkbenchError("--messages holds the whole conversation: give no prompt or --system with it")
        return read_messages(args.messages)
    if text is None:
        raise WorkbenchError("give a prompt, or --messages with a JSON file of chat messages")
    return text if args.system is None else conversation(text, args.system)


def cmd_run(args: argparse.Namespace) -> None:
    if (args.file is None) == (args.prompt is None and args.messages is None):
        raise WorkbenchError("give one prompt (or --messages), or --file with a prompt a line")
    prompt = command_line_prompt(args, args.prompt) if args.file is None else None
    if args.top_k < 1:
        raise WorkbenchError(f"--top-k must be at least 1, got {args.top_k}")
    model = _load(args)
    if prompt is not None:
        _print_distribution(next_token_distribution(model, model.to_ids(prompt, chat=args.chat), args.top_k),
                            args.json)
        return
    numbered = read_numbered_prompts(args.file)
    lines = [n for n, _ in numbered]
    try:
        ids = model.batch_ids([command_line_prompt(args, prompt) for _, prompt in numbered], chat=args.chat)
        batches = model.iter_batch(ids, batch_size=args.batch_size, logits="last")
    except WorkbenchError as err:
        raise type(err)(re.sub(r"^prompt (\d+):", lambda m: f"prompt {m[1]} (line {lines[int(m[1])]}):", str(err))
                        ) from None
    # Forwards finish longest prompts first: each result is printed once those before it in the file are, so only the
    # finished top-k lists wait (never a forward's logits), and the output keeps the file's order.
    waiting: dict[int, dict[str, Any]] = {}
    printed = 0
    for index, trace in batches:
        waiting[index] = next_token_distribution(model, ids[index], args.top_k, trace.logits[-1])
        while printed in waiting:
            result = waiting.pop(printed)
            _print_distribution({"index": printed, "line": lines[printed], **result} if args.json else result,
                                args.json)
            printed += 1


def json_line(value: Any) -> str:
    """``value`` as one line of strict JSON: NaN and infinities (logits of a model that overflows) become null, as the
    MCP server writes them, not the bare NaN that strict parsers refuse."""
    def finite(item: Any) -> Any:
        if isinstance(item, float) and not math.isfinite(item):
            return None
        if isinstance(item, dict):
            return {key: finite(v) for key, v in item.items()}
        return [finite(v) for v in item] if isinstance(item, (list, tuple)) else item

    return json.dumps(finite(value), allow_nan=False)


def _print_distribution(result: dict[str, Any], as_json: bool) -> None:
    if as_json:  # one JSON object a line
        print(json_line(result))
        return
    print(f"{len(result['ids'])} tokens: " + " ".join(repr(t) for t in result["tokens"]))
    for row in result["top_k"]:
        print(f"{row['prob']:8.4f}  {row['logprob']:9.4f}  {row['id']:>7}  {row['token']!r}")


def cmd_generate(args: argparse.Namespace) -> None:
    prompt = command_line_prompt(args, args.prompt)
    model = _load(args)
    kwargs = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, chat=args.chat,
                  compiled=args.compile)
    if args.compile and model.runner.device.type == "cpu":
        print("workbench: compiling the decode step after the first token (minutes the first time on this machine, "
              "seconds once torch has cached the build)", file=sys.stderr)
    if args.json:
        ids, pieces = [], []
        for token, text in model.stream(prompt, args.max_new_tokens, **kwargs):
            ids.append(token)
            pieces.append(text)
        print(json_line({"prompt": prompt, "ids": ids, "tokens": model.token_texts(ids), "text": "".join(pieces)}))
        return
    for _, text in model.stream(prompt, args.max_new_tokens, **kwargs):
        print(text, end="", flush=True)
    print()


def cmd_info(args: argparse.Namespace) -> None:
    model = _load(args)
    info = model.info()
    if args.json:
        print(json_line(info))
        return
    c = info["config"]
    print(f"{info['model']}  ({info['path']})")
    print(f"  architecture {c['architecture']}: {c['n_layers']} layers, d_model {c['d_model']}, "
          f"{c['n_heads']} heads / {c['n_kv_heads']} kv heads of {c['d_head']}, mlp {c['d_mlp']}, vocab {c['vocab_size']}")
    family = info["family"]
    if family["features"]:
        settings = "".join(f", {k} {v}" for k, v in family.items() if k not in ("name", "features"))
        print(f"  {family['name']} features: {'; '.join(family['features'])}{settings}")
    print(f"  parameters {info['parameters'] / 1e6:.1f}M, formats {info['tensor_formats']}")
    mib = 1 << 20
    file_part = f" (file {info['file_bytes'] / mib:.1f} MiB)" if info["file_bytes"] else ""
    print(f"  resident weights {info['weight_bytes'] / mib:.1f} MiB{file_part}; loaded in {info['load_seconds']:.2f}s")
    print(f"  device {info['device']}, dtype {info['dtype']}")
    by_kernel: dict[tuple[str, str], list[str]] = {}
    for name, k in info["kernels"].items():
        by_kernel.setdefault((k["format"], f"decode: {k['decode']}, prefill: {k['prefill']}"), []).append(name)
    for (fmt, kernels), names in by_kernel.items():
        print(f"  {fmt:6} {len(names):4} matrices  {kernels}")
    print("  between the matrices (eager): " + ", ".join(f"{op} {impl}" for op, impl in info["layer_ops"].items()))


def cmd_harvest(args: argparse.Namespace) -> None:
    """Runs as one process, or as every rank of a ``torchrun`` job (each on its own GPU unless --device/--devices)."""
    import workbench
    from workbench import distributed

    prompts = read_prompts(args.file)
    rank = distributed.init()
    device = args.device
    if device is None and args.devices is None and rank.world > 1:
        device = distributed.local_devices()[0]
    model = workbench.load(args.model, device=device, dtype=args.dtype, quantize=args.quantize, devices=args.devices)
    manifest = distributed.harvest(model, prompts, args.hook, reduce=args.reduce, out=args.out,
                                   shard_size=args.shard_size, batch_size=args.batch_size, retries=args.retries)
    if rank.rank == 0:
        meta = json.loads(manifest.read_text(encoding="utf-8"))
        summary = {"manifest": str(manifest), "prompts": meta["n_prompts"], "shards": len(meta["shards"]),
                   "rows": sum(s["rows"] for s in meta["shards"]), "ranks": rank.world}
        print(json_line(summary) if args.json else
              f"{summary['rows']} rows of {', '.join(meta['hooks'])} from {summary['prompts']} prompts in "
              f"{summary['shards']} shards ({rank.world} rank{'s' if rank.world > 1 else ''}): {manifest}")


def cmd_app(args: argparse.Namespace) -> None:
    import subprocess
    from pathlib import Path

    from workbench import app
    from workbench.quant_mix import check_quantize

    if args.model is not None and not Path(args.model).exists():
        raise WorkbenchError(f"model not found: {args.model}")
    script = Path(app.__file__).with_name("main.py")
    command = [sys.executable, "-m", "streamlit", "run", str(script), "--server.port", str(args.port),
               "--server.address", "127.0.0.1", "--server.headless", "true", "--browser.gatherUsageStats", "false",
               "--client.toolbarMode", "minimal",
               # the dashboard sets each widget's value to itself to keep it across pages (app/common.py)
               "--global.disableWidgetStateDuplicationWarning", "true"]
    command += ["--", "--numerics", args.numerics]
    if args.model is not None:
        command += ["--model", str(Path(args.model).resolve())]
    if args.quantize is not None:
        check_quantize(args.quantize)
        command += ["--quantize", args.quantize]
    for flag, value in (("--device", args.device), ("--dtype", args.dtype)):
        if value is not None:
            command += [flag, value]
    if args.devices is not None:
        command += ["--devices", ",".join(args.devices)]
    print(f"workbench dashboard on http://127.0.0.1:{args.port}", file=sys.stderr)
    returncode = subprocess.call(command)
    if returncode:
        raise SystemExit(returncode)


def cmd_replay(args: argparse.Namespace) -> int:
    """Exit status 0 when the replay is identical or within tolerance, 1 when it differs."""
    from workbench.replay import replay

    if args.numerics is not None:
        raise WorkbenchError("a replay computes in the numerics its trace recorded: --numerics does not apply")
    if args.model:
        report = replay(args.artifact, _load(args), force=args.force, rtol=args.rtol, atol=args.atol)
    elif args.quantize is not None:
        raise WorkbenchError("--quantize needs --model: without it the replay loads the trace's own model as recorded")
    else:  # the trace's own model, on the device and in the dtype given, else as recorded
        report = replay(args.artifact, force=args.force, rtol=args.rtol, atol=args.atol, device=args.device,
                        dtype=args.dtype, devices=args.devices)
    print(json_line(report.to_dict()) if args.json else report)
    return 0 if report.ok else 1


def cmd_parity(args: argparse.Namespace) -> int:
    """Exit status 0 when no point parts from llama.cpp by more than --tolerance, 1 when one does."""
    from workbench import parity

    parity.require_llama_cpp()
    model = _load(args)
    if args.control_vector_layer is not None:
        found = parity.control_vector_point(model, args.prompt, args.control_vector_layer, threads=args.threads)
        print(json_line(found) if args.json else
              f"llama.cpp adds direction.{found['layer']} at {found['first_changed']}: our {found['hook_point']}"
              f"{' (the change is the direction itself)' if found['delta_is_direction'] else ''}")
        return 0
    report = parity.parity(model, args.prompt, tolerance=args.tolerance, threads=args.threads,
                           flash_attention=args.flash_attention)
    print(json_line(report.to_dict()) if args.json else parity.format_report(report))
    return 0 if report.first_parting is None else 1


def cmd_mcp(args: argparse.Namespace) -> None:
    from workbench.mcp_server import serve

    serve(args.model, args.artifacts, http=args.http, host=args.host, port=args.port, device=args.device,
          dtype=args.dtype, quantize=args.quantize, devices=args.devices)


def _chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--system", default=None, metavar="TEXT",
                        help="a system prompt before the prompt (implies the chat template)")
    parser.add_argument("--messages", default=None, metavar="FILE.json",
                        help='a whole conversation instead of a prompt: a JSON list of {"role", "content"} messages '
                             "('-': standard input), rendered through the chat template; ending with an assistant "
                             "message continues it")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="next-token distribution of a prompt (or of every line of --file, batched)")
    run.add_argument("prompt", nargs="?")
    run.add_argument("--file", default=None, help="a text file of prompts, one a line ('-': standard input); with "
                     "--json, one JSON object a line")
    run.add_argument("--batch-size", type=int, default=None, help="prompts a forward (default: as many as fit)")
    run.add_argument("--top-k", type=int, default=10)
    _chat_args(run)
    _model_args(run)
    run.set_defaults(fn=cmd_run)

    gen = sub.add_parser("generate", help="generate a continuation, streaming tokens")
    gen.add_argument("prompt", nargs="?")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    _chat_args(gen)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                     help="build the decode step with torch.compile and wait for it (default: on CUDA, built in the "
                          "background while a graph of the eager forward answers; not on the CPU, where the first "
                          "build takes minutes, later ones seconds)")
    _model_args(gen)
    gen.set_defaults(fn=cmd_generate)

    info = sub.add_parser("info", help="config, tensor formats, memory, kernels")
    _model_args(info)
    info.set_defaults(fn=cmd_info)

    har = sub.add_parser("harvest", help="activations of every prompt of a file to safetensors shards (SAE training "
                         "data, probe datasets); under torchrun, sharded over the ranks")
    har.add_argument("--file", required=True, help="a text file of prompts, one a line ('-': standard input)")
    har.add_argument("--hook", required=True, action="append", help="a hook point name or glob (repeatable)")
    har.add_argument("--out", required=True, help="the folder of shards and manifest.json")
    har.add_argument("--reduce", type=_reduction, default=None,
                     help="none (every token's row), last, mean, or a position")
    har.add_argument("--shard-size", type=int, default=64, help="prompts a shard (a file, and a unit of retry)")
    har.add_argument("--batch-size", type=int, default=None, help="prompts a forward (default: as many as fit)")
    har.add_argument("--retries", type=int, default=2, help="times a failed shard is retried on another rank")
    _model_args(har)
    har.set_defaults(fn=cmd_harvest)

    dashboard = sub.add_parser("app", help="the Streamlit dashboard, on 127.0.0.1")
    _model_source_args(dashboard)
    dashboard.add_argument("--port", type=_port, default=8501)
    _device_args(dashboard)
    _numerics_arg(dashboard)
    dashboard.set_defaults(fn=cmd_app)

    par = sub.add_parser("parity", help="llama.cpp beside workbench, layer by layer, on one prompt (needs the "
                         "'reference' extra)")
    par.add_argument("prompt")
    par.add_argument("--tolerance", type=float, default=0.05,
                     help="a point parts where its largest difference passes this share of llama.cpp's largest value")
    par.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    par.add_argument("--flash-attention", default="auto", choices=["auto", "on", "off"],
                     help="llama.cpp's flash attention setting (its default: auto)")
    par.add_argument("--control-vector-layer", type=int, default=None, metavar="N",
                     help="instead: find which hook point llama.cpp's control vector direction.N acts on")
    _model_args(par)
    par.set_defaults(fn=cmd_parity)

    mcp = sub.add_parser("mcp", help="MCP server for agents: stdio, or streamable HTTP with --http")
    mcp.add_argument("--http", action="store_true", help="serve streamable HTTP at http://HOST:PORT/mcp instead of stdio")
    mcp.add_argument("--host", default="127.0.0.1", help="HTTP address (default: loopback only)")
    mcp.add_argument("--port", type=_port, default=8000)
    mcp.add_argument("--artifacts", default="artifacts", help="the only folder tools read and write (default: ./artifacts)")
    _model_source_args(mcp)
    _device_args(mcp)
    _numerics_arg(mcp)
    mcp.set_defaults(fn=cmd_mcp)

    rep = sub.add_parser("replay", help="re-run a saved trace and compare: identical / within tolerance / different")
    rep.add_argument("artifact", help="trace directory written by Trace.save")
    rep.add_argument("--force", action="store_true", help="replay on a model whose fingerprint differs")
    rep.add_argument("--rtol", type=float, default=1e-3, help="tolerance relative to each tensor's largest value")
    rep.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance")
    _model_args(rep)
    rep.set_defaults(fn=cmd_replay, numerics=None)  # a replay computes in the numerics its trace recorded
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from workbench.kernels import numerics

    args = build_parser().parse_args(argv)
    try:
        with numerics(getattr(args, "numerics", None) or "exact"):
            status = args.fn(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
    except WorkbenchError as err:
        print(f"workbench: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader left (``| head``): stop quietly, and point stdout at devnull so the flush at exit cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE
    except Exception as err:  # a bug, or a failure the checks missed: still one line (the traceback on request)
        if os.environ.get("WORKBENCH_TRACEBACK"):
            raise
        print(f"workbench: internal error ({type(err).__name__}): {clip(str(err), 200)} (WORKBENCH_TRACEBACK=1 "
              "shows the traceback)", file=sys.stderr)
        return 3
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
