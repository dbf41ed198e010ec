"""Fused kernels from other libraries, behind the operators the passes claim.

Each module wraps one library's kernels for one operator, says where they
apply (`applies`), and is imported lazily: the library is optional.
"""
