"""Pure-read DRAM bandwidth of this GPU (torch.sum over 1 GiB), to read the memory-bound % against."""
import torch, triton.testing
x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
t = triton.testing.do_bench(lambda: x.sum(), warmup=20, rep=200, return_mode="median") * 1e-3
print(f"pure read (torch.sum of 1 GiB bf16): {x.numel() * 2 / t / 1e12:.2f} TB/s")
