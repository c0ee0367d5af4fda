"""Version shims: what the extension needs on any machine to follow the supported Megatron-Core
versions (0.16.1 and 0.19.x), one module per concern, chosen by feature checks, never applied on
import: `mixers` (the stock GDN / Mamba modules' names and parameters), `mtp` (multi-token
prediction), `dsa` (DeepSeek sparse attention, and the torch fallback of its Hadamard kernel),
`lm_api` (Megatron-LM's ``pretrain()`` calling forms).

Running Megatron on a CPU host is not a version matter: that is `megatron_tree.cpu`.
"""
