"""Host cost of calling an operator registered with ``torch.library.custom_op`` against one registered with a plain
``torch.library.Library`` (what :func:`fp8engine.fp8.library.kernel_op` does), per call, on tiny CPU tensors: the
dispatch wrapper's cost alone, which a compiled graph pays at run time for every call of an opaque op. (A measurement
tool; the figures are machine-dependent.)

Usage: python tools/op_overhead.py [--calls 3000]
"""
import argparse
import time

import torch


def _time_us(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args()

    def body(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None,
             transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape, dtype=fp8_dtype), scale.new_empty((1,))

    custom = torch.library.custom_op("op_overhead::custom", body, mutates_args=("amax",))
    lib = torch.library.Library("op_overhead", "FRAGMENT")
    lib.define("plain" + torch.library.infer_schema(body, mutates_args=("amax",)))
    lib.impl("plain", body, "CompositeExplicitAutograd")
    plain = torch.ops.op_overhead.plain.default
    x, scale, amax = torch.randn(4, 64), torch.ones(1), torch.zeros(1)
    rows = [("the function itself", lambda: body(x, scale, torch.float8_e4m3fn, amax, False)),
            ("torch.library.custom_op", lambda: custom(x, scale, torch.float8_e4m3fn, amax, False)),
            ("torch.library.Library (kernel_op)", lambda: plain(x, scale, torch.float8_e4m3fn, amax, False))]
    print("| registration | us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {_time_us(fn, args.calls):.1f} |")


if __name__ == "__main__":
    main()
