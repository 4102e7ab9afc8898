"""The server under Poisson load: its service rate, and p99 latency against offered rate.

Starts `python -m minillm serve` (or uses --url), measures the service rate mu (4 x
max_num_seqs workload requests sent at once: completed requests per second at full batch), then,
with --sweep, offers Poisson arrivals at multiples of mu (0.25 .. 2) for --duration
seconds each and records TTFT / ITL / e2e percentiles and the error rate at each rate.
Latency stays flat while rho = lambda / mu is small and climbs steeply as rho -> 1: the knee.
The queue is long enough (--max-queue-len 1024) that nothing is shed: past mu the waiting
time grows instead. Prompts are the benchmark workload's (16-256 random tokens), each asking
for --max-tokens tokens (greedy, EOS ignored).

    python benchmarks/serve_load.py --sweep [--duration 45] [--max-tokens 32]
    python benchmarks/serve_load.py --rate 2 --duration 30
Writes benchmarks/results/serve_load.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from minillm.devices import default_device  # noqa: E402
from minillm.serve import ServerProcess, loadgen  # noqa: E402
from serve_common import machine  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
OUT = Path(__file__).with_name("results") / "serve_load.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--sweep", action="store_true", help="sweep rates from 0.25 to 2 x mu")
    ap.add_argument("--rate", type=float, default=None, help="one rate (req/s) instead")
    ap.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per rate")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.sweep == (args.rate is not None):
        ap.error("give --sweep or --rate R")
    info = {"machine": machine(), "max_tokens": args.max_tokens,
            "max_num_seqs": args.max_num_seqs, "duration_s": args.duration}
    server = None if args.url else ServerProcess(max_num_seqs=args.max_num_seqs,
                                                 max_queue_len=1024)
    url = args.url or server.url
    try:
        cap = loadgen.measure_capacity(url, num_requests=4 * args.max_num_seqs,
                                       max_tokens=args.max_tokens)
        mu = cap.throughput_req_s
        print(f"service rate mu = {mu:.3f} req/s ({cap.throughput_tok_s:.1f} output tok/s, "
              f"{cap.num_requests} requests at once, {cap.num_errors} errors)", flush=True)
        info.update(service_rate_req_s=mu, capacity=cap.to_dict())
        rates = [round(f * mu, 4) for f in FRACTIONS] if args.sweep else [args.rate]
        results = []
        for rate in rates:
            results.append(loadgen.run_load(url, rate, args.duration, max_tokens=args.max_tokens,
                                            timeout_s=600))
            print(results[-1].summary(), flush=True)
        info["runs"] = [{**r.to_dict(), "rho": r.rate / mu} for r in results]
        print(loadgen.ascii_curve(results, "e2e", 99))
        print(loadgen.ascii_curve(results, "ttft", 99))
    finally:
        if server is not None:
            info["server_exit_code"] = server.stop()
    # The device a server started here runs on (with --url, this machine's default).
    write_result(args.out, info, indent=1, device=default_device(),
                 argv=None if argv is None else [__file__, *argv])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
