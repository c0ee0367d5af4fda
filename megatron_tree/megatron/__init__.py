"""Megatron-Core glue: tree packed-seq params, layer specs, modules, depth RoPE, loss, verify.

Import the submodules you need (``megatron_tree.megatron.specs``, ``.model``, ...); importing this
package does not import Megatron-Core's heavy modules.
"""
