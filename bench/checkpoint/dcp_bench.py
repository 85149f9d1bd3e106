# PyTorch DCP side of the checkpoint benchmark (run with torch.distributed.run, gloo): the same state as
# bench_ckpt.cpp (16 x 3 tensors [rows, 4096] fp32, Shard(0) DTensors, the same data formula), dcp.save then
# dcp.load into other tensors, page cache dropped (posix_fadvise) before the load. Prints one JSON line on rank 0.
# --keep leaves step-1 for a resharding load; --reshard-from DIR loads that checkpoint (saved on 2 ranks) into
# Shard(0) over this world's ranks instead, each rank's rows checked against the formula.
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

def rows_of_key(key_index, row0, rows, cols):
    # bench_ckpt.cpp's formula, same float32 ops: (r % 1000) + 0.25 * key_index + 1e-4 * c
    r = torch.arange(row0, row0 + rows, dtype=torch.long).remainder(1000).to(torch.float32) + 0.25 * key_index
    c = torch.arange(cols, dtype=torch.float32) * 1e-4
    return r.unsqueeze(1) + c.unsqueeze(0)

def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default

def sharded(keys, rows, cols, mesh, rank, n, fill):
    out = {}
    for i, key in enumerate(keys):
        local = rows_of_key(i, rank * (rows // n), rows // n, cols) if fill else torch.empty(rows // n, cols)
        out[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(rows, cols), stride=(cols, 1))
    return out

def main():
    gb = float(arg("--gb", "0.5"))
    root = arg("--dir", "/tmp/fsdp_ckpt_bench") + "/dcp"
    reshard_from = arg("--reshard-from", None)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    cols, tensors = 4096, 16
    rows = int(gb * 1e9 / 4 / cols / tensors) // 12 * 12
    keys = sorted(k for i in range(tensors) for k in (f"layers.{i}.weight", f"optimizer.state.layers.{i}.weight.exp_avg",
                                                      f"optimizer.state.layers.{i}.weight.exp_avg_sq"))
    if reshard_from:
        dst = sharded(keys, rows, cols, mesh, rank, n, fill=False)
        if rank == 0:
            drop_cache(reshard_from)
        dist.barrier()
        t0 = time.monotonic()
        dcp.load(dst, checkpoint_id=reshard_from)
        dist.barrier()
        load_s = time.monotonic() - t0
        ok = torch.tensor([0.0 if all(torch.equal(dst[k].to_local(), rows_of_key(i, rank * (rows // n), rows // n, cols))
                                      for i, k in enumerate(keys)) else 1.0])
        dist.all_reduce(ok)
        if rank == 0:
            print(json.dumps({"side": "pytorch_dcp", "reshard_load_ranks": n, "load_s": round(load_s, 3),
                              "equal": ok.item() == 0}), flush=True)
        dist.barrier()
        dist.destroy_process_group()
        return
    sd = sharded(keys, rows, cols, mesh, rank, n, fill=True)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    t0 = time.monotonic()
    dcp.save(sd, checkpoint_id=root + "/step-1")
    dist.barrier()
    save_s = time.monotonic() - t0
    drop_cache(root)
    dst = sharded(keys, rows, cols, mesh, rank, n, fill=False)
    dist.barrier()
    t0 = time.monotonic()
    dcp.load(dst, checkpoint_id=root + "/step-1")
    dist.barrier()
    load_s = time.monotonic() - t0
    equal = all(torch.equal(sd[k].to_local(), dst[k].to_local()) for k in sd)
    # Warm: the files in the page cache (a restart on the same host right after the save).
    for v in dst.values():
        v.to_local().zero_()
    dist.barrier()
    t0 = time.monotonic()
    dcp.load(dst, checkpoint_id=root + "/step-1")
    dist.barrier()
    warm_load_s = time.monotonic() - t0
    equal = equal and all(torch.equal(sd[k].to_local(), dst[k].to_local()) for k in sd)
    if rank == 0:
        state_gb = sum(v.to_local().numel() * 4 for v in sd.values()) * n / 1e9
        print(json.dumps({"side": "pytorch_dcp", "torch": torch.__version__, "ranks": n, "state_gb": round(state_gb, 3),
                          "save_s": round(save_s, 3), "load_s": round(load_s, 3), "warm_load_s": round(warm_load_s, 3),
                          "equal": equal}), flush=True)
        if "--keep" not in sys.argv:
            shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
