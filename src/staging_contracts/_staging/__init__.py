"""The torch data path: layout math, the decode ring allocator, gather and scatter kernels.

:mod:`.layout` (which heads each rank holds, where each writer's bytes sit in a region),
:mod:`.allocator` (the round-based staging ring and its watermark), :mod:`.kernels` (gather
into a staging buffer, scatter into paged KV pools, on CPU or CUDA), :mod:`.fused_pools`
(every pool of a rank as rows of one allocation) and :mod:`.host_rows` (CPU row copies through
NumPy). No I/O, no threads of its own.

May import: ``protocols`` and ``stats`` only.
Imported by: ``_decode``, ``_prefill``, ``backends``, ``_cluster``, ``_bench``, ``testing``.
"""
