"""``fullshard bench``: timings of fullshard on this machine, as ratios.

- :mod:`.main`: the command line, dispatching to the benchmarks below.
- :mod:`.compare`: fullshard against torch FSDP2 and DDP, on the workloads of :mod:`.workloads`.
- :mod:`.gpu`: the GPT presets on one CUDA device (throughput, CPU offload).
- :mod:`.micro`: the prefetch-setting and CPU-optimizer micro benchmarks.
- :mod:`.report`: the machine line, generated markdown sections, the chart.
"""
