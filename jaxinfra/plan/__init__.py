"""`jaxinfra plan`: will a config fit, how fast will it run, on how many chips (docs/plan.md).

Modules (each imports only the ones before it):

    layout.py       a config on a device count: validated mesh and every per-device size
    activations.py  what one layer keeps for its backward under each remat policy, and its working set
    memory.py       memory per device as a list of components (params ... optimizer update) and the peak
    devices.py      the device table (memory, peak FLOP/s, bandwidth, efficiency); CPU from the matmul probe
    links.py        the link table, which link a mesh axis uses, collective times; measured links
    time.py         executed FLOPs, collectives per mesh axis, overlap, bubble, step time, bottleneck
    roofline.py     ridge points, a matmul's intensity, the FSDP and tensor link rooflines and crossovers
    estimate.py     Plan: memory + step time + throughput, MFU, bottleneck, JSON
    inference.py    --inference: params + KV cache, decode step
    search.py       --search: layouts that fit, ranked by predicted step time
    compiled.py     --compile: XLA's memory analysis of the real train step (fake CPU devices if needed)
    report.py       text output; the one line `jaxinfra train` prints
    cli.py          the `plan` subcommand and `jaxinfra train`'s pre-flight check
"""
