"""`TreeDotProductAttention`: Megatron core-attention over a packed tree.

Drop-in for ``core_attention`` in a Megatron ``SelfAttention`` spec: same constructor and forward
protocol as ``DotProductAttention`` / ``TEDotProductAttention``. The visibility mask comes from the
`TreeLayout` in ``packed_seq_params`` (never a dense mask); ``attention_mask`` is ignored.

Config mapping:
  window_size=(left, 0) (+ window_attn_skip_freq)  -> sliding window on depth: q - k <= left
  softmax_type="learnable"                         -> learned sink logit per head (``softmax_offset``)
  softmax_type="off-by-one"                        -> sink logit fixed at 0
  apply_query_key_layer_scaling                    -> no-op on the math (Megatron rescales it back)
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from ..ops.attention import tree_attention
from .packed_seq import get_tree_layout


class TreeDotProductAttention(MegatronModule):
    """Core attention over a tree: inputs ``[s, 1, heads, dim]``, output ``[s, 1, heads * dim_v]``."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        backend: str = "auto",
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        name: Optional[str] = None,  # instance name (megatron-core 0.19+ builders); not used here
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"TreeDotProductAttention supports self-attention only, got {attention_type!r}")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.no_mask,
                                  AttnMaskType.arbitrary):
            raise ValueError(f"TreeDotProductAttention is causal along tree paths; got attn_mask_type={attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"tree attention has no attention dropout (got attention_dropout={dropout}); set "
                "--attention-dropout 0 (TransformerConfig.attention_dropout=0.0), as LLM training usually does")
        self.layer_number = max(1, layer_number)
        self.cp_comm_type = cp_comm_type
        self.backend = backend
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(
                required_pgs=["tp", "cp"] if config.context_parallel_size > 1 else ["tp"])
        self.pg_collection = pg_collection
        tp = pg_collection.tp.size()
        self.num_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        # k_channels / v_channels: query-key and value head widths when they differ (MLA builds its
        # core attention with qk_head_dim + qk_pos_emb_head_dim and v_head_dim); the output is
        # [s, 1, heads * v_channels], which tree_attention gives for any value width
        head_dim = k_channels if k_channels is not None else divide(config.kv_channels * config.num_attention_heads,
                                                                    config.num_attention_heads)
        self.k_channels, self.v_channels = head_dim, (v_channels if v_channels is not None else head_dim)
        # Megatron's layer scaling divides the scale by layer_number and multiplies the scores back
        # inside the softmax: the net scale is unchanged, so it is ignored here.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.window = self.layer_window(config, layer_number)
        self.softcap = None  # attention logit soft-cap c (c tanh(s / c)): a family core sets it (`family_cores`)
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type == "vanilla":
            self.softmax_offset = None
        elif softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(self.num_heads_per_partition, dtype=config.params_dtype),
                                 persistent=False)
        elif softmax_type == "learnable":
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            self.softmax_offset = torch.nn.Parameter(
                torch.empty(self.num_heads_per_partition, device=device, dtype=config.params_dtype))
            setattr(self.softmax_offset, "tensor_model_parallel", True)
            setattr(self.softmax_offset, "partition_dim", 0)
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
            else:
                torch.nn.init.zeros_(self.softmax_offset)
        else:
            raise ValueError(f"unsupported softmax_type {softmax_type!r}")

    def layer_window(self, config, layer_number: int) -> Optional[int]:
        """This layer's window ``w`` on depth (a query sees keys with ``q - k < w``), None for full
        attention: stock's ``window_size=(left, 0)`` on the layers ``window_attn_skip_freq`` selects.
        A family whose layers choose their window otherwise overrides this (`family_cores`)."""
        if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            return None
        left, right = config.window_size
        if right not in (0, -1) or left < 0:
            raise ValueError(f"tree attention is causal: window_size must be (left >= 0, 0), got {config.window_size}")
        return left + 1  # q - k <= left  <=>  q - k < left + 1

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if attention_bias is not None:
            raise ValueError("TreeDotProductAttention does not take an attention_bias")
        layout = get_tree_layout(packed_seq_params)
        s, b = query.shape[:2]
        if b != 1:
            raise ValueError(f"tree attention expects micro-batch size 1 (the tree is the batch), got {b}")
        sinks = None if self.softmax_offset is None else self.softmax_offset
        if self.config.context_parallel_size > 1:
            return self._forward_cp(query, key, value, packed_seq_params, sinks)
        if getattr(packed_seq_params, "carry", None) is not None:
            return self._forward_carry(query, key, value, packed_seq_params, sinks)
        if s != layout.num_rows:
            raise ValueError(f"sequence length {s} != tree layout rows {layout.num_rows}")
        out = tree_attention(query[:, 0], key[:, 0], value[:, 0], layout, softmax_scale=self.softmax_scale,
                             window=self.window, sinks=sinks, backend=self.backend, softcap=self.softcap)
        return out.reshape(s, 1, -1)

    def _forward_carry(self, query, key, value, psp, sinks):
        """Carry: the own rows attend to own and carried K / V (`cp.execution.carry.carried_attention`)."""
        from ..cp.execution.carry import carried_attention  # the executor sits below this package

        view = psp.carry
        s = query.shape[0]
        if s != len(view.own):
            raise ValueError(f"carry: the input covers {s} rows but the microbatch owns {len(view.own)}")
        out = carried_attention(query[:, 0], key[:, 0], value[:, 0], psp.layout, view, ("attention", self.layer_number),
                                softmax_scale=self.softmax_scale, window=self.window, sinks=sinks, backend=self.backend,
                                softcap=self.softcap)
        return out.reshape(s, 1, -1)

    def _forward_cp(self, query, key, value, psp, sinks):
        """Tree CP: this rank's owned rows attend to every visible row of the CP group (`tree_attention_cp`).

        The local sequence is ``psp.local_rows`` followed by ``psp.num_local_padding`` rows that pad it
        to a multiple of the TP size; padding rows attend to nothing (output 0) and are never attended.
        """
        plan = psp.cp_plan
        s = query.shape[0]
        n = psp.cp_owned_rows(s, type(self).__name__)
        from ..cp import tree_attention_cp  # the executor sits below this package

        if getattr(psp, "carry", None) is not None:  # carry under CP: carried K / V enter the CP attention
            from ..cp.execution.carry import carried_attention_cp

            out = carried_attention_cp(query[:n, 0], key[:n, 0], value[:n, 0], psp.carry,
                                       ("attention", self.layer_number), softmax_scale=self.softmax_scale,
                                       window=self.window, sinks=sinks, backend=self.backend, softcap=self.softcap)
        else:
            out = tree_attention_cp(query[:n, 0], key[:n, 0], value[:n, 0], plan, self.pg_collection.cp,
                                    softmax_scale=self.softmax_scale, window=self.window, sinks=sinks,
                                    backend=self.backend, softcap=self.softcap)
        out = out.reshape(n, 1, out.shape[1] * out.shape[2])  # n may be 0: a rank that owns nothing
        if s > n:
            out = torch.cat([out, out.new_zeros(s - n, 1, out.shape[-1])])
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = {}
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            state_dict["softmax_offset"] = self.softmax_offset
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets)
