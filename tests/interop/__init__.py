"""Interoperability with the reference serving stack (SGLang's staging path), against its code.

The suite installs the pinned reference wheel into a cache folder outside the source tree
(``_reference.py`` says where and how), imports its disaggregation modules on a CPU machine,
and checks our frames, allocator, layout, kernels, contract tools and a staged transfer
against its real functions and classes. No code of the reference lives in this repository.
"""
