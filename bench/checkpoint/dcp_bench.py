# PyTorch DCP side of the checkpoint benchmark (run with torch.distributed.run, 2 ranks, gloo): the same state
# as bench_ckpt.cpp (16 x 3 tensors [rows, 4096] fp32, Shard(0) DTensors), dcp.save then dcp.load into other
# tensors, page cache dropped (posix_fadvise) before the load. Prints one JSON line on rank 0.
import json, os, shutil, sys, time
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

def drop_cache(root):
    for d, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

def main():
    gb = float(sys.argv[sys.argv.index("--gb") + 1]) if "--gb" in sys.argv else 0.5
    root = (sys.argv[sys.argv.index("--dir") + 1] if "--dir" in sys.argv else "/tmp/fsdp_ckpt_bench") + "/dcp"
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    cols, tensors = 4096, 16
    rows = int(gb * 1e9 / 4 / cols / tensors) // n * n
    sd = {}
    for i in range(tensors):
        fqn = f"layers.{i}.weight"
        for key in (fqn, f"optimizer.state.{fqn}.exp_avg", f"optimizer.state.{fqn}.exp_avg_sq"):
            sd[key] = DTensor.from_local(torch.randn(rows // n, cols), mesh, [Shard(0)], run_check=False)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    t0 = time.monotonic()
    dcp.save(sd, checkpoint_id=root + "/step-1")
    dist.barrier()
    save_s = time.monotonic() - t0
    drop_cache(root)
    dst = {k: DTensor.from_local(torch.empty_like(v.to_local()), mesh, [Shard(0)], run_check=False) for k, v in sd.items()}
    dist.barrier()
    t0 = time.monotonic()
    dcp.load(dst, checkpoint_id=root + "/step-1")
    dist.barrier()
    load_s = time.monotonic() - t0
    equal = all(torch.equal(sd[k].to_local(), dst[k].to_local()) for k in sd)
    if rank == 0:
        state_gb = sum(v.to_local().numel() * 4 for v in sd.values()) * n / 1e9
        print(json.dumps({"side": "pytorch_dcp", "torch": torch.__version__, "ranks": n, "state_gb": round(state_gb, 3),
                          "save_s": round(save_s, 3), "load_s": round(load_s, 3), "equal": equal}), flush=True)
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
