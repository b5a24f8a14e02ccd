"""The reference engine: EAGLE-3 speculative decoding in plain PyTorch over the HF target (CPU or GPU).

Split by concern the way vLLM splits its spec-decode code:
  engine.py      the Engine protocol: load, generate (streaming), one decode step (draft -> verify -> accept)
  scheduler.py   continuous batching: requests join and leave between steps, one loop owns the model
  kv_cache.py    the running rows' KV state: the target's batched HF cache with slot validity, the drafter's
                 preallocated cache, the target forward
  proposer.py    drafting: the drafter's extend over verified positions, chains and SGLang's top-k trees
  drafts.py      draft chains (as tensors) and trees, with their attention masks
  acceptance.py  the target's distribution, greedy and rejection-sampling acceptance (chains vectorised)
  output.py      cutting at stop tokens and budgets, incremental detokenisation into chunks
  checks.py      what a request, a speculative config and a drafter must satisfy
  sequence.py    one request's decoding state

SGLang's parameters mean the same here:
  num_steps         draft depth (drafter forwards per round, the first one shared with the draft extend)
  eagle_topk        1: a chain of num_steps tokens; >1: a tree, each step keeps the topk best partial paths
  num_draft_tokens  tree: tokens the target verifies per round, the root (last accepted token) included;
                    chain: always num_steps + 1 (SGLang forces the same)

Positions. Committed tokens are x_0..x_{L-1}; the target KV cache holds positions 0..L-2 and x_{L-1} (the last
bonus token) is the root of the next verify. The drafter at position t reads (target aux states at t, embedding
of x_{t+1}) and predicts x_{t+2} (drafter/ttt.py); its KV cache holds one entry per position 0..L-2. A round:
  1. draft: from the drafter's last output (position L-2) draft a chain/tree of tokens for positions L..
  2. verify: one target forward over [x_{L-1}, drafts] (tree attention mask for a tree), capturing aux states
  3. accept: walk the tree from the root (greedy: match the target argmax; sampling: rejection sampling),
     plus one bonus token from the target's distribution at the last accepted node
  4. keep the target cache entries of the root and the accepted path; run the drafter over those positions
     (its "extend"), which also yields the logits of the next round's first draft.
Accept length = tokens emitted per verify step, bonus included (SGLang's spec accept length).

Losslessness. Greedy: every emitted token is the target's argmax given the committed prefix, so the output is
the target's own greedy output (up to float reordering in batched vs single-token forwards). Sampling: at a node
with target distribution q, each child x with draft distribution p is accepted with probability min(1, q(x)/p(x));
on rejection q <- norm(max(0, q - p)) and the next child is tried; if no child is accepted the bonus is sampled
from q. Chains sample their drafts from the drafter (p = draft probabilities); trees pick the drafter's top-k
deterministically, so p is one-hot at the draft (accept with q(x), remove x from q on rejection). Either way each
emitted token is distributed exactly as the target's q.
"""
