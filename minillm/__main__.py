"""Command line: `python -m minillm generate "prompt"`, `info`, `serve` (the OpenAI-style
server, `minillm.serve`) and `loadgen` (Poisson load against a local server).

Tensor parallel: `torchrun --nproc-per-node N -m minillm generate --tp N "prompt"` prints the
same text from rank 0 (the other ranks print nothing). `--tp` is checked against the model's
heads and torchrun's world size before any rank loads a weight or connects to another.

Bad arguments exit with status 2 and a one-line message (argparse's convention).
"""
from __future__ import annotations

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _float_in(lo, hi, name):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{name} must lie in [{lo}, {hi}], got {value}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="minillm", description="A small LLM inference engine (SmolLM2-135M).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="stream a completion to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=64)
    gen.add_argument("--temperature", type=_float_in(0.0, 10.0, "--temperature"), default=0.0)
    gen.add_argument("--top-p", type=_float_in(1e-6, 1.0, "--top-p"), default=None)
    gen.add_argument("--top-k", type=_positive_int, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the model's chat template")
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    gen.add_argument("--device", type=_device, default=None,
                     help="cpu, cuda or cuda:N (default: MINILLM_DEVICE, else CUDA when a GPU "
                          "is visible, else cpu)")
    gen.add_argument("--backend", choices=["torch", "triton"], default="torch")
    gen.add_argument("--compile", action="store_true",
                     help="run decode steps through torch.compile (the first one compiles)")
    gen.add_argument("--tp", type=_positive_int, default=1,
                     help="tensor-parallel size; N > 1 runs under torchrun --nproc-per-node N")
    info = sub.add_parser("info", help="model config, sizes, this machine's ceilings and "
                                       "which C++ CPU kernels run")
    info.add_argument("--refresh", action="store_true",
                      help="re-measure this machine and the CPU kernel selection")
    _add_serve_parsers(sub)
    return parser


def _positive_float(name):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {value}")
        return value
    return parse


def _rates(text):
    return [_positive_float("--sweep rate")(r) for r in text.split(",") if r.strip()]


def _device(text):
    """--device: a device of this machine, spelled as given; one line naming the devices
    available otherwise (argparse exits 2 with it)."""
    from .devices import DeviceError, parse_device
    try:
        parse_device(text, "--device")
    except DeviceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip().lower()


def _add_serve_parsers(sub) -> None:
    from .serve.config import ServeConfig
    d = ServeConfig()
    srv = sub.add_parser("serve", help="the OpenAI-compatible HTTP server (minillm.serve)")
    srv.add_argument("--host", default=d.host, help="address to bind (default: loopback)")
    srv.add_argument("--port", type=int, default=d.port)
    srv.add_argument("--max-num-seqs", type=_positive_int, default=d.max_num_seqs)
    srv.add_argument("--max-queue-len", type=_positive_int, default=d.max_queue_len,
                     help="waiting requests past which new ones get 503")
    srv.add_argument("--num-blocks", type=_positive_int, default=None,
                     help="KV blocks in the pool (default: sized from memory)")
    srv.add_argument("--block-size", type=_positive_int, default=d.block_size)
    srv.add_argument("--max-num-batched-tokens", type=_positive_int,
                     default=d.max_num_batched_tokens,
                     help="tokens per engine step (default: 512 on a CPU, 8192 on CUDA)")
    srv.add_argument("--drain-timeout", type=_positive_float("--drain-timeout"),
                     default=d.drain_timeout_s, help="SIGTERM: seconds to finish in-flight work")
    srv.add_argument("--health-timeout", type=_positive_float("--health-timeout"),
                     default=d.health_timeout_s)
    srv.add_argument("--default-max-tokens", type=_positive_int, default=d.default_max_tokens)
    srv.add_argument("--max-n", type=_positive_int, default=d.max_n)
    srv.add_argument("--retry-after", type=_positive_int, default=d.retry_after_s)
    srv.add_argument("--stream-tokens-per-event", type=_positive_int,
                     default=d.stream_tokens_per_event,
                     help="SSE buffering: tokens per streamed event after the first")
    srv.add_argument("--stall-timeout", type=_positive_float("--stall-timeout"),
                     default=d.stall_timeout_s,
                     help="seconds one engine step may run before /health/live fails")
    srv.add_argument("--device", type=_device, default=None,
                     help="cpu, cuda or cuda:N (default: MINILLM_DEVICE, else CUDA when a GPU "
                          "is visible, else cpu)")
    srv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                     help="default: bfloat16 on CUDA (float16 before Ampere), float32 on a CPU")
    srv.add_argument("--attn-backend", choices=["torch", "triton"], default=None,
                     help="the engine's attention kernels (default: triton on CUDA, where "
                          "its steps replay CUDA graphs; torch on a CPU)")
    srv.add_argument("--log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug"])
    lg = sub.add_parser("loadgen", help="Poisson load against a local server; latency percentiles")
    lg.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    lg.add_argument("--rate", type=_positive_float("--rate"), help="requests per second")
    lg.add_argument("--duration", type=_positive_float("--duration"), required=True,
                    help="seconds of arrivals (per rate)")
    lg.add_argument("--sweep", type=_rates, default=None,
                    help="comma-separated rates: run each and draw p99 against rate")
    lg.add_argument("--max-tokens", type=_positive_int, default=None,
                    help="tokens per request (default: the workload's own lengths)")
    lg.add_argument("--no-stream", action="store_true")
    lg.add_argument("--seed", type=int, default=0)
    lg.add_argument("--timeout", type=_positive_float("--timeout"), default=120.0)
    lg.add_argument("--json", default=None, help="write the results to this file")


def cmd_serve(args) -> int:
    from .serve.config import ServeConfig
    from .serve.server import serve
    config = ServeConfig(host=args.host, port=args.port, max_num_seqs=args.max_num_seqs,
                         max_queue_len=args.max_queue_len, num_blocks=args.num_blocks,
                         block_size=args.block_size,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         drain_timeout_s=args.drain_timeout, health_timeout_s=args.health_timeout,
                         default_max_tokens=args.default_max_tokens, max_n=args.max_n,
                         retry_after_s=args.retry_after, device=args.device, dtype=args.dtype,
                         stream_tokens_per_event=args.stream_tokens_per_event,
                         stall_timeout_s=args.stall_timeout, attn_backend=args.attn_backend)
    return serve(config, log_level=args.log_level)


def cmd_loadgen(args) -> int:
    import json
    from .serve import loadgen
    if (args.rate is None) == (args.sweep is None):
        raise ValueError("give exactly one of --rate R or --sweep R1,R2,...")
    kw = dict(max_tokens=args.max_tokens, seed=args.seed, stream=not args.no_stream,
              timeout_s=args.timeout)
    results = []
    for rate in args.sweep or [args.rate]:
        results.append(loadgen.run_load(args.url, rate, args.duration, **kw))
        print(results[-1].summary(), flush=True)
    if args.sweep:
        print(loadgen.ascii_curve(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in results], f, indent=1)
    return 0


def _dtype(name, device):
    import torch
    from .devices import default_dtype
    return getattr(torch, name) if name else default_dtype(device)


def cmd_generate(args) -> int:
    import os
    if args.tp > 1 or "WORLD_SIZE" in os.environ:
        return cmd_generate_tp(args)
    from . import generate_stream, load_model
    from .devices import resolve_device
    device = resolve_device(args.device)
    model, tok = load_model(dtype=_dtype(args.dtype, device), device=device,
                            attn_backend=args.backend)
    tokens = generate_stream(model, _prompt_ids(args, tok), args.max_new_tokens,
                             args.temperature, args.top_k, args.top_p, args.seed,
                             compile=args.compile)
    return _print_stream(tokens, tok)


def cmd_generate_tp(args) -> int:
    """One rank of `torchrun --nproc-per-node N -m minillm generate --tp N`."""
    import os
    import torch.distributed as tdist
    from . import dist, load_model
    from .config import ModelConfig
    dist.check_tp_size(ModelConfig.smollm2_135m(), args.tp)  # before any rank does work
    if args.compile:
        raise ValueError("--compile is not supported with --tp; drop one of them")
    rank, _ = dist.init_from_env(args.tp)
    try:
        device = dist.rank_device(rank)
        model, tok = load_model(dtype=_dtype(args.dtype, device), device=device,
                                attn_backend=args.backend)
        dist.shard_model(model, rank, args.tp)
        tokens = dist.tp_generate_stream(model, _prompt_ids(args, tok), args.max_new_tokens,
                                         args.temperature, args.top_k, args.top_p, args.seed)
        if rank == 0:
            return _print_stream(tokens, tok)
        for _ in tokens:  # every rank runs every step; only rank 0 prints
            pass
        return 0
    finally:
        tdist.destroy_process_group()


def _prompt_ids(args, tok) -> list[int]:
    return (tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat
            else tok.encode(args.prompt))


def _print_stream(tokens, tok) -> int:
    """Print tokens as they come, up to EOS (not printed)."""
    out: list[int] = []
    shown = ""
    for token in tokens:
        if token == tok.eos_token_id:
            break
        out.append(token)
        # Decode the whole tail so multi-byte characters split across tokens print whole.
        text = tok.decode(out)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    return 0


def cmd_info(args) -> int:
    from . import calc
    from .config import ModelConfig
    from .perf import measure_machine
    config = ModelConfig.smollm2_135m()
    n = config.num_params()
    print(f"model: {config.name}")
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "rope_theta", "max_position_embeddings"):
        print(f"  {field:24s} {getattr(config, field)}")
    print(f"  parameters               {n:,} (tied embeddings counted once)")
    print("weight bytes:")
    for name, nbytes in (("float32", 4), ("bfloat16", 2), ("int8", 1), ("int4", 0.5)):
        print(f"  {name:9s} {calc.weight_bytes(n, nbytes) / 1e6:8.1f} MB")
    print(f"KV cache per token: {config.kv_bytes_per_token(4) / 1e3:.1f} KB fp32, "
          f"{config.kv_bytes_per_token(2) / 1e3:.1f} KB bf16")
    profile = measure_machine(refresh=args.refresh)
    bw = profile.bandwidth_bytes_per_s
    print(f"this machine ({profile.device_name}, {profile.num_threads} threads):")
    print(f"  memory bandwidth         {bw / 1e9:.1f} GB/s")
    for dtype, flops in profile.matmul_flops.items():
        print(f"  matmul {dtype:10s}        {flops / 1e9:.1f} GFLOP/s")
    print("bandwidth-bound batch-1 decode ceiling (weights read once per token):")
    for name, nbytes in (("float32", 4), ("bfloat16", 2)):
        print(f"  {name:9s} {calc.decode_tokens_per_s(n, nbytes, bw):6.1f} tok/s")
    print_cpu_kernels(refresh=args.refresh)
    return 0


def print_cpu_kernels(refresh: bool = False) -> None:
    """Which build of each C++ CPU kernel runs which shapes here, or the PyTorch path
    (`minillm.cpu_select`); `refresh` measures again (MINILLM_CPU_KERNEL unset or 1)."""
    from . import cpu_select
    sel = cpu_select.select(refresh=refresh) if refresh else cpu_select.current()
    when = f", measured {sel.measured_at}" if sel.measured_at else ""
    print(f"CPU kernels (MINILLM_CPU_KERNEL={sel.setting}; {sel.source}{when}):")
    for line in sel.lines():
        print(f"  {line}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "info": cmd_info, "serve": cmd_serve,
                "loadgen": cmd_loadgen}[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        import os
        if os.environ.get("RANK", "0") == "0":  # under torchrun: one message, from rank 0
            print(f"minillm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
