"""Tools: the ``distca-hf`` command and what it runs.

    cli           the ``distca-hf`` entry point (``env`` and the subcommands below)
    launch        ``distca-hf launch``: accelerate launch with a ``distca:`` section in the config
    bench         ``distca-hf bench``: multi-process step time, colocated against distca
    simulate      ``distca-hf simulate``: cluster-scale balance, bytes and speedup, no processes
    profiling     ``distca-hf profile``: the time model's constants on this device
    kernel_bench  ``distca-hf kernel-bench``: the exact attention paths side by side
"""
