"""FLOP counts of the decoder: the model FLOPs that MFU divides, and the packer's cost.

N counts the matmul params: q/k/v/o projections, the SwiGLU MLP and the LM head
(D V; the embedding lookup, norms and biases do no matmul). Per trained token at
position p of its sequence, a train step needs

  6 N + 12 L H E (p + 1)

FLOPs: 2 N forward and 4 N backward for the weights, and per layer 2 H E (p + 1)
each for Q K^T and P V over the p + 1 causal keys, forward, and twice that backward.
These are model FLOPs: what the math needs, not what an implementation executes
(padding, masked attention blocks, recomputation under remat); `executed_matmul_flops`
reads the latter from a compiled program.
"""

import math
import re

import numpy as np



def matmul_params(cfg) -> int:
  """N: params that take part in a matmul per token."""
  D, F, H, K, E, L, V = (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                         cfg.n_layers, cfg.vocab_size)
  return L * (D * (H + 2 * K) * E + H * E * D + 3 * D * F) + D * V


def train_flops(cfg, positions) -> float:
  """Model FLOPs of a forward and backward over tokens at `positions` (valid tokens only)."""
  positions = np.asarray(positions)
  LHE = cfg.n_layers * cfg.n_heads * cfg.head_dim
  return 6.0 * matmul_params(cfg) * positions.size + 12.0 * LHE * float((positions + 1).sum())


def attention_break_even_len(cfg) -> float:
  """Row length at which a row's causal attention costs as many FLOPs as its matmuls.

  Over a row of T tokens causal attention averages about T / 2 keys per token, so
  12 L H E T / 2 = 6 N at T = N / (L H E). `batching.pack_dynamic` weighs a row of
  length T by 1 + T / this.
  """
  return matmul_params(cfg) / (cfg.n_layers * cfg.n_heads * cfg.head_dim)


_ARRAY_SHAPE = re.compile(r"^[a-z]\w*\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")


def _dims(shape: str):
  m = _ARRAY_SHAPE.match(shape)
  return [int(d) for d in m.group(1).split(",") if d] if m else None


def executed_matmul_flops(hlo_text: str) -> float:
  """Matmul FLOPs a compiled program executes, from its optimised HLO text.

  XLA's `cost_analysis()` counts the body of a while loop once, so a step that scans
  over layers and micro-batches reads several times too low. This walk counts each
  dot as 2 x (output elements) x (contracted size), multiplies a loop body by its
  `known_trip_count`, descends into fusions and calls, and takes the costliest
  branch of a conditional (the train step's `lax.cond` skips only empty
  micro-batches; `attention.blockwise` switches to a narrower key window when the
  sequences allow, so this is an upper bound there). Elementwise work is not
  counted, as model FLOPs leave it out.

  Raises:
    ValueError: if a while loop has no known trip count.
  """
  comps, entry, body = {}, None, None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header:
      body = comps.setdefault(header.group(2), [])
      entry = header.group(2) if header.group(1) else entry
    elif body is not None and line.startswith("  "):
      body.append(line.strip())
  memo = {}

  def cost(name):
    if name in memo:
      return memo[name]
    shapes, total = {}, 0.0
    for line in comps[name]:
      m = _INSTRUCTION.match(line)
      if not m:
        continue
      inst, shape, op, rest = m.groups()
      shapes[inst] = _dims(shape)
      if op == "dot":
        lhs = shapes[re.match(r"%([\w.\-]+)", rest).group(1)]
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
        k = math.prod(lhs[int(d)] for d in contracting.split(",") if d)
        total += 2.0 * math.prod(_dims(shape)) * k
      elif op in ("fusion", "call"):
        callee = re.search(r"(?:calls|to_apply)=%([\w.\-]+)", rest)
        total += cost(callee.group(1)) if callee else 0.0
      elif op == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
        if not trips:
          raise ValueError(f"while loop {inst} has no known trip count")
        total += int(trips.group(1)) * cost(re.search(r"body=%([\w.\-]+)", rest).group(1))
      elif op == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        names = (re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else
                 re.findall(r"(?:true|false)_computation=%([\w.\-]+)", rest))
        total += max(cost(b) for b in names)
    memo[name] = total
    return total

  return cost(entry)
