"""Tools: the ``distca-hf`` command and what it runs.

    cli               the ``distca-hf`` entry point (``env`` and the subcommands below)
    launch            ``distca-hf launch``: accelerate launch with a ``distca:`` section in the config
    bench/            ``distca-hf bench``: multi-process step time, colocated against distca; ``--workload long``:
                      one document over every rank, distca against per-document CP and Ulysses;
                      ``--pipeline-parallel P``: stock 1F1B colocated, CAD per stage and cad_1f1b side by side
                      on real processes (the trainer's stages and runner). A package, one job a file: its
                      ``__init__`` lists them
    context_parallel  per-document context parallelism, head-tail balanced: the bench's CP baseline
    ulysses           DeepSpeed Ulysses (ALST) over distca's kernel: the bench's Ulysses baseline
    simulate          ``distca-hf simulate``: cluster-scale balance, bytes and speedup, no processes
    simulate_tables   ``distca-hf simulate``'s text tables
    simulate_mixed    ``distca-hf simulate --sliding-window``: models mixing sliding and full layers
    simulate_checks   ``distca-hf simulate``'s sizes, checked before anything is drawn
    simulate_plot     ``distca-hf simulate --plot``: its figure
    length_samples    the document-length files the commands read (``--lengths``, ``sample:FILE.json``), checked
    profiling         ``distca-hf profile``: the time model's constants on this device
    kernel_bench      ``distca-hf kernel-bench``: the exact attention paths side by side
    docs_reference    the generated pages of docs/ (the settings and command-line references): ``make docs``
    output_paths      the files the commands write (``--out``, ``--plot``, ``--trace``), checked before they run
    machine_limits    the processes (``--world``), threads (``--threads``) and memory a command may ask of this machine
"""
