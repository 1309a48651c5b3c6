"""Where the wall time of a Llama-3-8B block through ``bakron.quantize_layers`` goes (cupy).

Builds the block of ``python -m bakron.bench_stack --gpu --block`` (random weights, Wishart
Hessians made on the GPU), runs it twice to compile and warm up, times three rounds, times
``prepare_factor`` of each distinct Hessian on its own, and writes a cProfile of one more
round (sorted by cumulative and by internal time)::

    python scripts/gpu_block_profile.py profile.txt

Needs cupy and a CUDA device; docs/benchmarks/gpu.md ("A Llama-3-8B block through the
runner") reports what it found.
"""
import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="file for the cProfile listing")
    args = ap.parse_args()
    import cupy

    import bakron
    from bakron.benchmarks.stack import LLAMA3_8B_BLOCK, llama_block_layers

    layers = llama_block_layers(cupy.random.default_rng(0))
    sync = cupy.cuda.get_current_stream().synchronize

    def run():
        res = bakron.quantize_layers(layers, bits=2, tile=(16, 16), metrics="none")
        sync()
        return res

    run()
    run()
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        res = run()
        walls.append(time.perf_counter() - t0)
    print("wall ms", [round(w * 1e3, 1) for w in walls],
          "| solves ms", round(sum(r.seconds_solve for r in res) * 1e3, 1),
          "| factors ms", [round(r.seconds_factor * 1e3, 1) for r in res], flush=True)
    hess = {}  # each shared Hessian once, by the name the block gives it
    for (_, _, _, hin, hout), (_, H_in, H_out) in zip(LLAMA3_8B_BLOCK, layers):
        hess[hin], hess[hout] = H_in, H_out
    for key, H in hess.items():
        bakron.prepare_factor(H, 16)
        sync()
        t0 = time.perf_counter()
        bakron.prepare_factor(H, 16)
        sync()
        print(f"prepare_factor {key} ({H.shape[0]}): "
              f"{(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
    pr = cProfile.Profile()
    pr.enable()
    run()
    pr.disable()
    s = io.StringIO()
    stats = pstats.Stats(pr, stream=s).sort_stats("cumulative")
    stats.print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    with open(args.out, "w") as f:
        f.write(s.getvalue())


if __name__ == "__main__":
    main()
