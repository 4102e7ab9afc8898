"""Soak: 2,000 requests at about 80% of the measured service rate, against a real server.

Passes when there is no 5xx answer at all (503 included: at rho = 0.8 nothing should be
shed), no KV block is held once the load is over, and the server's resident memory is
flat: the median RSS of the last tenth of the run is within 10% of the first tenth's
(sampled every second, after a warm-up of 50 requests).

Requests are short (the workload's prompts cut to 32 tokens, 8 new tokens) so that 2,000 of
them fit in about ten minutes on 2 cores.

    python benchmarks/serve_soak.py [--requests 2000] [--fraction 0.8] [--max-tokens 8]
Writes benchmarks/results/serve_soak.json; exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from minillm.devices import default_device  # noqa: E402
from minillm.serve import ServerProcess, loadgen  # noqa: E402
from minillm.serve.metrics import parse_prometheus  # noqa: E402
from serve_common import machine, rss_bytes  # noqa: E402
from result_file import write_result  # noqa: E402  (benchmarks/result_file.py)

OUT = Path(__file__).with_name("results") / "serve_soak.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--fraction", type=float, default=0.8, help="of the measured service rate")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32,
                    help="the workload's prompts cut to this many tokens")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    info = {"machine": machine(), "max_tokens": args.max_tokens, "requests": args.requests,
            "prompt_tokens": args.prompt_tokens}
    prompts = [p[:args.prompt_tokens] for p, _ in loadgen.workload_prompts()]
    kw = dict(prompts=prompts, max_tokens=args.max_tokens)
    with ServerProcess(max_num_seqs=args.max_num_seqs, max_queue_len=4096) as server:
        loadgen.run_load(server.url, 5.0, 10.0, seed=99, **kw)  # warm-up
        cap = loadgen.measure_capacity(server.url, 4 * args.max_num_seqs, **kw)
        rate = args.fraction * cap.throughput_req_s
        duration = args.requests / rate
        print(f"mu = {cap.throughput_req_s:.2f} req/s; soaking at {rate:.2f} req/s for "
              f"{duration:.0f} s", flush=True)
        samples, stop = [], threading.Event()

        def sample_rss():
            while not stop.wait(1.0):
                samples.append(rss_bytes(server.pid))
        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        result = loadgen.run_load(server.url, rate, duration, seed=1, timeout_s=600, **kw)
        stop.set()
        sampler.join()
        time.sleep(1.0)
        m = parse_prometheus(httpx.get(server.url + "/metrics").text)
        exit_code = server.stop()
    tenth = max(1, len(samples) // 10)
    first, last = statistics.median(samples[:tenth]), statistics.median(samples[-tenth:])
    leaked = m["minillm:kv_cache_num_blocks"] - m["minillm:kv_cache_free_blocks"]
    num_5xx = sum(n for code, n in result.status_counts.items() if code >= 500)
    checks = {"zero_5xx": num_5xx == 0, "zero_errors": result.num_errors == 0,
              "zero_leaked_blocks": leaked == 0 and m["minillm:num_requests_running"] == 0,
              "rss_flat_within_10pct": abs(last - first) <= 0.10 * first,
              "clean_exit": exit_code == 0}
    info.update(service_rate_req_s=cap.throughput_req_s, rate_req_s=rate, duration_s=duration,
                result=result.to_dict(), num_5xx=num_5xx, leaked_blocks=leaked,
                rss_first_tenth_mb=first / 2**20, rss_last_tenth_mb=last / 2**20,
                rss_samples=len(samples), checks=checks)
    print(result.summary())
    print(f"5xx {num_5xx}, leaked blocks {leaked:.0f}, RSS {first / 2**20:.0f} -> "
          f"{last / 2**20:.0f} MB; checks: {checks}")
    # The server ran on this machine's default device, as `python -m minillm serve` does.
    write_result(args.out, info, indent=1, device=default_device(),
                 argv=None if argv is None else [__file__, *argv])
    print(f"wrote {args.out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
