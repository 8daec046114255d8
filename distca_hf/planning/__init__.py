"""Planning: pure functions from document lengths to where every CA-task runs and what it moves.

No torch.distributed here; every function is deterministic, so any rank computes the same plan
from the same all-gathered lengths (``runtime.shared_planning`` spreads ``"auto"``'s candidates over
the ranks and shares the one kept), and all of it is tested without processes. The modules, in
data-path order; each imports only modules above it (``tests/test_structure.py`` checks it, and
that no import, at module level or inside a function, closes a circle):

    cost       pairs, FLOPs, bytes per token, imbalance and the time model (one home per formula)
    documents  boundaries of packed documents in one rank's micro-batch (``find_documents``)
    ranges     integer index helpers: concatenated ranges, a fast lexsort of integer keys
    tasks      CA-tasks (a query shard + its K/V prefix) and fused varlen batches
    pieces     every rank's documents as pieces, the planner's input
    carving    CA-tasks -> attention servers at a fixed tolerance, few bytes moved (``Plan``, ``PlannerConfig``)
    transfers  the K/V ranges and bytes a plan moves, and the memory it makes ranks hold for backward
    relay_trees  K/V relay trees (servers forwarding a holder's K/V to the next servers that need it):
               a plan's ``RelayTrees`` and the sends they make (``plan_kv_sends``)
    baselines  what each rank does under the methods distca is compared with (packing, WLB-LLM,
               per-document CP, Ulysses): tokens, pairs, tasks, bytes; ``distca-hf simulate`` times them
    rank_time  a plan's predicted seconds per rank: the one home of the time formula the judges, the
               descent, the tiles and the simulator use (``base_pairs``' other work included)
    layer_bound  a lower bound on the predicted layer time of any plan of a batch (what a planner could still win)
    relay      relay trees placed on a plan by time (``kv_relays="auto"``), and a plan's bytes and time
               with any relayed sends (the what-ifs of ``examples/relay_whatif.py``)
    key_split  key-split CA-tasks (2D tiles: queries against part of their keys), their checks and the
               tiles of one task given where its earlier prefix pieces are computed (``task_tiles``)
    tiles      key-split tiles chosen by time: a (server, document, holder piece) transfer becomes full
               tiles on the holder only where the predicted slowest rank gets faster (``apply_time_tiles``),
               or where a rank would hold more than the memory budget (``apply_memory_tiles``)
    descent    tolerance="auto"'s main candidate: a greedy descent on the predicted layer time, both
               ends of every link counted, a document's fan-out bounded
    rehome     a plan over the memory budget brought within it by moving whole groups of served tasks
               to servers with room in memory and time (``rehome_within_memory``)
    zigzag     per-document context parallelism (zigzag chunks over a document's holders) as CA-tasks:
               the CP-shaped candidate of tolerance="auto"
    tile_grid  a dominant long document as a grid of key-split tiles placed by time: the candidate of
               tolerance="auto" whose bytes do not grow with the document's prefix
    by_time    tolerance="auto": the plan the time model predicts fastest (colocated, the descent, the
               fixed-tolerance carvings, the CP-shaped plan, the tile grid) within the memory budget
    planner    ``plan_tasks``, the entry point: by time (its candidates one by one), or a fixed tolerance, within the memory budget
    splits     a plan's waves and a micro-batch's two ping-pong nano-batches
    pipeline   the lockstep 1F1B schedule of ``pipeline_schedule="cad_1f1b"`` as a table of ticks, and the
               event models timing a step of it and of torch's stock 1F1B
    micro_batches  a step's documents over its micro-batch rows, balanced for attention at equal tokens
    pipeline_cost  one pipeline step timed for stock 1F1B (colocated / balanced micro-batches), CAD
               inside each stage and CAD across stages (``distca-hf simulate --pipeline-parallel``)
    pipeline_bound  floors of a pipeline step under that model (attention spread evenly, no byte between
               servers): the bound on CAD across stages over CAD inside each stage
"""

from .cost import (LLAMA3_8B_BYTES, LLAMA3_8B_H100, TimeModel, TokenBytes, attention_flops, causal_pairs,
                   default_time_model, document_pairs, imbalance, key_start, resolve_time_model, start_with_pairs,
                   tile_pairs)
from .documents import DocumentBoundaryError, PackedDocuments, find_documents
from .pieces import DocumentPieces, RankDocuments, rank_documents, stitch_rank_documents
from .planner import Plan, PlannerConfig, auto_candidates, chosen_candidate, colocated_plan, plan_candidate, plan_tasks
from .ranges import concat_ranges
from .key_split import check_tiles, full_tiles, with_key_ranges
from .splits import NanoAssignment, NanoSplit, assign_nano_batches, check_splittable, split_nano_batches, wave_plans
from .tasks import CATask, FusedBatch, fuse_tasks, fused_batch, split_document, whole_document_tasks
from .transfers import (BackwardMemory, CommBytes, KVTransfers, QuerySends, backward_memory, comm_bytes, kv_kept,
                        kv_received, kv_transfers, query_sends)
from .pipeline import (BACKWARD, FORWARD, PipelineRun, Tick, backward_slot, forward_slot, in_flight_micro_batches,
                       lockstep_1f1b_ticks, simulate_1f1b, simulate_lockstep, stock_1f1b_order)
from .micro_batches import balance_micro_batches
from .rank_time import loads_seconds, other_seconds, plan_loads, rank_seconds, step_seconds
from .by_time import AUTO_TOLERANCES, plan_by_time
from .pipeline_cost import plan_lockstep_tick

__all__ = [
    "AUTO_TOLERANCES", "BackwardMemory", "backward_memory", "kv_kept", "BACKWARD", "FORWARD", "Tick", "backward_slot", "forward_slot", "in_flight_micro_batches",
    "lockstep_1f1b_ticks", "plan_lockstep_tick", "PipelineRun", "simulate_1f1b", "simulate_lockstep", "stock_1f1b_order",
    "balance_micro_batches", "CATask", "CommBytes", "DocumentBoundaryError", "DocumentPieces", "FusedBatch", "KVTransfers", "LLAMA3_8B_BYTES",
    "LLAMA3_8B_H100", "NanoAssignment", "NanoSplit", "PackedDocuments", "Plan", "PlannerConfig", "RankDocuments", "TimeModel", "TokenBytes",
    "assign_nano_batches", "attention_flops", "causal_pairs", "check_splittable", "colocated_plan", "comm_bytes", "concat_ranges", "default_time_model", "document_pairs", "find_documents", "resolve_time_model", "key_start",
    "fuse_tasks", "fused_batch", "imbalance", "kv_received", "kv_transfers", "plan_by_time", "plan_tasks",
    "auto_candidates", "plan_candidate", "chosen_candidate",
    "rank_seconds", "step_seconds", "loads_seconds", "plan_loads", "other_seconds", "rank_documents", "split_document", "split_nano_batches",
    "start_with_pairs", "stitch_rank_documents", "wave_plans", "whole_document_tasks",
    "check_tiles", "full_tiles", "with_key_ranges", "tile_pairs", "QuerySends", "query_sends",
]
