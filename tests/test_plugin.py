"""DistCAPlugin: validation naming the bad setting, precedence code > DISTCA_* > YAML file > defaults,
the data x pipeline x tensor topology against a brute-force enumeration, the attention-server
process groups on real gloo ranks, the recipes as Accelerate reads them, and the launch checks
(`accelerate launch --cpu --num_processes 2` starting one process is stopped with an explanation)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_harness import run_ranks
from distca_hf import DistCAPlugin, ParallelTopology
from distca_hf.runtime import processes
from distca_hf.training import launch_checks as launch_module
from distca_hf.config import reset_config
from distca_hf.state import reset_state

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ("DISTCA_TOLERANCE", "DISTCA_BACKWARD", "DISTCA_OVERLAP", "DISTCA_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    yield
    reset_config()


# -- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, message", [
    ("overlap", "bogus", r"DistCAPlugin.overlap must be one of \['none', 'wave', 'pingpong'\], got 'bogus'"),
    ("backward", "later", r"DistCAPlugin.backward must be one of"),
    ("tolerance", -0.1, r"DistCAPlugin.tolerance must be a finite number >= 0"),
    ("tolerance", float("nan"), r"DistCAPlugin.tolerance"),
    ("block", 0, r"DistCAPlugin.block must be an integer from 1 to 2147483647"),
    ("timeout_s", 0, r"DistCAPlugin.timeout_s must be a number of seconds from 0.001"),
    ("mode", "remote", r"DistCAPlugin.mode must be one of \['distca', 'colocated'\]"),
    ("servers", [], r"DistCAPlugin.servers must be a non-empty list"),
    ("servers", [0, 0], r"DistCAPlugin.servers must be a non-empty list of distinct ranks"),
    ("servers", 3, r"DistCAPlugin.servers must be a list of ranks"),
    ("servers", {0: 1}, r"DistCAPlugin.servers must be a list of ranks, got \{0: 1\}"),  # (read as its keys before)
    ("server_group", "rack", r"DistCAPlugin.server_group must be one of \['data_parallel', 'node'\]"),
    ("tensor_parallel_size", 0, r"DistCAPlugin.tensor_parallel_size must be an integer >= 1"),
    ("data_parallel_size", 1.5, r"DistCAPlugin.data_parallel_size must be an integer >= 1"),
])
def test_bad_settings_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        DistCAPlugin(**{field: value})


def test_plugin_refuses_what_is_no_parallelism_config_nor_settings_and_takes_numpy_world_sizes():
    """``parallelism_config=5`` was read as all sizes 1, ``file_settings=None`` failed in ``dict()``, and
    ``topology(np.int64(4))`` said "world_size must be an integer >= 1, got np.int64(4)"."""
    import numpy as np

    with pytest.raises(ValueError, match="DistCAPlugin.parallelism_config must be an accelerate ParallelismConfig"):
        DistCAPlugin(parallelism_config=5)
    with pytest.raises(ValueError, match="DistCAPlugin.file_settings must be a dict"):
        DistCAPlugin(file_settings=None)
    # "the distca: section.tolerence: unknown setting", and a TypeError for a topology size, before
    with pytest.raises(ValueError, match=r"DistCAPlugin.file_settings: unknown setting\(s\) \['tolerence'\]"):
        DistCAPlugin(file_settings={"tolerence": 0.1})
    with pytest.raises(ValueError, match=r"\['pipeline_parallel_size'\] are DistCAPlugin fields: pass them as keyword"):
        DistCAPlugin(file_settings={"pipeline_parallel_size": 2})
    assert DistCAPlugin().topology(np.int64(4)).data_parallel == 4


def test_pipeline_stages_with_tensor_parallelism_are_refused_naming_the_source():
    """A pipeline stage runs whole layers on one rank: the plugin refuses tensor parallelism beside it
    wherever the size comes from (its own field, accelerate's ParallelismConfig), not only the trainer."""
    from accelerate import ParallelismConfig

    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 with tensor_parallel_size=2 \(from "
                                         r"DistCAPlugin.tensor_parallel_size\) is not supported"):
        DistCAPlugin(pipeline_parallel_size=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 \(from DistCAPlugin\.parallelism_config\.tp_size\)"):
        DistCAPlugin(pipeline_parallel_size=2, parallelism_config=ParallelismConfig(tp_size=2))
    assert DistCAPlugin(pipeline_parallel_size=2, tensor_parallel_size=1).topology(4).pipeline_parallel == 2


def test_pipeline_settings_are_checked_where_the_plugin_is_made(tmp_path, monkeypatch):
    """Too few micro-batches for 1f1b are refused by the plugin (not at the first step), naming the
    setting and both numbers; pipeline settings without stages warn that they do nothing."""
    from accelerate import ParallelismConfig

    with pytest.raises(ValueError, match=r"DistCAPlugin\(pipeline_parallel_size=4\): pipeline_schedule='1f1b' needs "
                                         r"at least 4 micro-batches .* got pipeline_micro_batches=3"):
        DistCAPlugin(pipeline_parallel_size=4, pipeline_micro_batches=3)
    for schedule in ("gpipe", "cad_1f1b"):  # they run any number
        DistCAPlugin(pipeline_parallel_size=4, pipeline_micro_batches=3, pipeline_schedule=schedule)
    with pytest.warns(UserWarning, match="pipeline_schedule set but pipeline_parallel_size is 1"):
        plugin = DistCAPlugin(pipeline_schedule="cad_1f1b")
    with warnings.catch_warnings():  # once, where it was made: not again when the Accelerator's config joins
        warnings.simplefilter("error")
        joined = plugin.with_parallelism(ParallelismConfig(dp_shard_size=1))
    assert joined.parallelism_config is not None and joined.pipeline_schedule == "cad_1f1b"
    with pytest.warns(UserWarning, match="pipeline_micro_batches set but pipeline_parallel_size is 1"):
        DistCAPlugin(file_settings={"pipeline_micro_batches": 8})
    with monkeypatch.context() as environment:  # a variable left set for a pipelined run: said too
        environment.setenv("DISTCA_PIPELINE_SCHEDULE", "cad_1f1b")
        with pytest.warns(UserWarning, match="DISTCA_PIPELINE_SCHEDULE set but pipeline_parallel_size is 1"):
            DistCAPlugin()
    with monkeypatch.context() as environment:  # every "said but ignored" warning reads the variables alike
        environment.setenv("DISTCA_MEMORY_BUDGET", "0.2")
        with pytest.warns(UserWarning, match="memory_budget=0.2 set but backward='resend' keeps nothing on servers"):
            DistCAPlugin(backward="resend")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DistCAPlugin(pipeline_parallel_size=2, pipeline_schedule="gpipe")
        DistCAPlugin()
        DistCAPlugin(mode="colocated", backward="resend")  # (spanning prefixes run in it)
    # planner settings under mode="colocated", which plans nothing, were ignored without a word
    with pytest.warns(UserWarning, match="tolerance, servers set but mode='colocated' plans nothing .* they are ignored"):
        DistCAPlugin(mode="colocated", tolerance=0.1, servers=[0])
    with pytest.warns(UserWarning, match="kv_relays set but mode='colocated' plans nothing .* it is ignored"):
        DistCAPlugin(file_settings={"mode": "colocated", "kv_relays": "off"})
    with warnings.catch_warnings():  # a recipe's planner settings serve both halves of a comparison: no word
        warnings.simplefilter("error")
        DistCAPlugin(mode="colocated", file_settings={"tolerance": "auto", "kv_relays": "off"})
    # a time-model file that passes the setting's shallow check failed at the first plan
    bad = tmp_path / "model.json"
    bad.write_text('{"linear_s_per_token": -1, "attn_s_per_pair": 1e-10}')
    with pytest.raises(ValueError, match="the time_model setting's file is not a valid time model: .*linear_s_per_token "
                                         "must be between 0"):
        DistCAPlugin(time_model=str(bad))
    with pytest.warns(UserWarning, match="memory_budget=0.2 set but backward='resend' keeps nothing on servers"):
        DistCAPlugin(backward="resend", memory_budget=0.2)
    with warnings.catch_warnings():  # an unbounded budget says nothing resend would ignore
        warnings.simplefilter("error")
        DistCAPlugin(file_settings={"backward": "resend", "memory_budget": None})
    # cad_1f1b pools over every rank: settings that pick servers inside a stage were refused at the first
    # step (servers) or ignored (server_group), and ping-pong's downgrade to wave was said only then
    cad = dict(pipeline_parallel_size=2, pipeline_schedule="cad_1f1b")
    with pytest.raises(ValueError, match=r"'cad_1f1b'\): .* the servers setting \(\(0, 3\), .* unset "):
        DistCAPlugin(**cad, servers=[0, 3])
    with pytest.raises(ValueError, match="server_group='node' does not apply"):
        DistCAPlugin(**cad, server_group="node")
    with pytest.warns(UserWarning, match="overlap='pingpong' runs as overlap='wave' there"):
        DistCAPlugin(**cad, overlap="pingpong")
    DistCAPlugin(pipeline_parallel_size=2, pipeline_schedule="1f1b", servers=[0], server_group="node")  # per stage


@pytest.mark.parametrize("variable, value", [("DISTCA_OVERLAP", "bogus"), ("DISTCA_BACKWARD", "x"),
                                             ("DISTCA_TOLERANCE", "lots"), ("DISTCA_TIMEOUT_S", "-1")])
def test_bad_environment_names_the_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"invalid {variable}="):
        DistCAPlugin()


def test_precedence_code_environment_file_defaults(monkeypatch, tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 2\n"
                    "distca:\n  tolerance: 0.2\n  backward: resend\n  block: 16\n  overlap: wave\n"
                    "  tensor_parallel_size: 2\n")
    assert DistCAPlugin().resolved().tolerance == "auto"  # defaults
    plugin = DistCAPlugin.from_accelerate_config(path)
    resolved = plugin.resolved()
    assert (resolved.tolerance, resolved.backward, resolved.block, resolved.overlap) == (0.2, "resend", 16, "wave")
    assert plugin.tensor_parallel_size == 2
    monkeypatch.setenv("DISTCA_TOLERANCE", "0.3")
    monkeypatch.setenv("DISTCA_BACKWARD", "saved")
    resolved = DistCAPlugin.from_accelerate_config(path).resolved()
    assert (resolved.tolerance, resolved.backward, resolved.block) == (0.3, "saved", 16)  # environment beats file
    resolved = DistCAPlugin.from_accelerate_config(path, tolerance=0.4, block=8).resolved()
    assert (resolved.tolerance, resolved.block) == (0.4, 8)  # code beats both
    assert DistCAPlugin(tolerance=0.5).resolved().tolerance == 0.5


def test_attach_applies_the_settings_process_wide():
    import distca_hf

    distca_hf.configure(backward="resend")  # an earlier configure() does not leak into the plugin's job...
    with pytest.warns(UserWarning, match=r"distca_hf.configure\(\) \(backward='resend'\) are dropped"):  # ...said
        groups = DistCAPlugin(tolerance=0.07, mode="colocated").attach()
    with warnings.catch_warnings():  # the settings of the plugin attached before are no user's: no word
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*plans nothing")  # (its tolerance under colocated: said)
        DistCAPlugin(mode="colocated").attach()
        groups = DistCAPlugin(tolerance=0.07, mode="colocated").attach()
    assert groups.server_ranks == (0,) and groups.group is None and groups.topology.world_size == 1
    current = distca_hf.current_config()
    assert (current.tolerance, current.mode, current.backward) == (0.07, "colocated", "saved")
    assert groups.config == current


def test_servers_beyond_the_group_are_refused_on_one_process():
    with pytest.raises(ValueError, match=r"servers=\(0, 1\).*server group \[0\] has 1 rank\(s\) \(world size 1"):
        DistCAPlugin(servers=[0, 1]).attach()


def test_yaml_section_errors_name_file_and_key(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("distca:\n  tolerence: 0.1\n")
    with pytest.raises(ValueError, match=r"cfg.yaml: unknown key\(s\) \['tolerence'\] in the distca: section"):
        DistCAPlugin.from_accelerate_config(path)
    path.write_text("distca:\n  overlap: sideways\n")
    with pytest.raises(ValueError, match=r"cfg.yaml: distca.overlap must be one of"):
        DistCAPlugin.from_accelerate_config(path)
    path.write_text("distca: 3\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        DistCAPlugin.from_accelerate_config(path)
    path.write_text("distca:\n  servers: 1\n")
    with pytest.raises(ValueError, match="distca.servers must be a list"):
        DistCAPlugin.from_accelerate_config(path)
    # words as their DISTCA_* variables spell them; YAML 1.1 reads an unquoted off as false
    path.write_text("distca:\n  kv_relays: off\n  tolerance: AUTO\n  memory_budget: None\n  backward: Resend\n")
    resolved = DistCAPlugin.from_accelerate_config(path).resolved()
    assert (resolved.kv_relays, resolved.tolerance, resolved.memory_budget, resolved.backward) == \
        ("off", "auto", None, "resend")
    path.write_text("num_processes: 2\n")
    assert DistCAPlugin.from_accelerate_config(path).resolved().tolerance == "auto"  # no section: defaults
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DistCAPlugin.from_accelerate_config(tmp_path / "missing.yaml")
    with pytest.raises(IsADirectoryError, match="is a folder; name the YAML file in it"):  # "does not exist" before
        DistCAPlugin.from_accelerate_config(tmp_path)
    # a key written twice: YAML keeps the last one, so the first setting was dropped without a word
    path.write_text("distca:\n  tolerance: 0.1\n  overlap: wave\n  tolerance: 0.3\n")
    with pytest.raises(ValueError, match=r"cfg.yaml: not valid YAML: key 'tolerance' is given twice \(lines 2 and 4\)"):
        DistCAPlugin.from_accelerate_config(path)
    # a YAML merge key may be overridden: not a duplicate
    path.write_text("base: &b {num_processes: 2}\njob:\n  <<: *b\n  num_processes: 4\ndistca:\n  tolerance: 0.2\n")
    assert DistCAPlugin.from_accelerate_config(path).resolved().tolerance == 0.2
    path.write_text("distca:\n  tolerance: " + "[" * 5000 + "]" * 5000 + "\n")  # (a RecursionError before)
    with pytest.raises(ValueError, match=r"cfg.yaml: not a config file \(YAML nested too deeply\)"):
        DistCAPlugin.from_accelerate_config(path)


# -- recipes as Accelerate reads them ---------------------------------------------------------------


@pytest.mark.parametrize("name, processes", [("cpu-2proc", 2), ("single-node", 8), ("multi-node", 16),
                                             ("deepspeed-zero2", 8), ("deepspeed-zero3", 8)])
def test_recipes_load_in_accelerate(name, processes):
    from accelerate.commands.config import load_config_from_file

    config = load_config_from_file(str(RECIPES / f"{name}.yaml"))
    assert config.num_processes == processes
    assert not config.use_cpu  # use_cpu would make accelerate launch start a single process
    if name.startswith("deepspeed"):
        ds_file = REPO / config.deepspeed_config["deepspeed_config_file"]
        stage = int(name[-1])
        assert json.loads(ds_file.read_text())["zero_optimization"]["stage"] == stage
    else:
        assert config.distributed_type.value == "MULTI_GPU"


def test_accelerate_refuses_a_distca_key_so_the_section_has_its_own_file(tmp_path):
    """The fact behind recipes/distca.yaml: accelerate launch rejects keys it does not know."""
    from accelerate.commands.config import load_config_from_file

    path = tmp_path / "with-section.yaml"
    path.write_text((RECIPES / "cpu-2proc.yaml").read_text() + "distca:\n  tolerance: 0.1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_config_from_file(str(path))
    plugin = DistCAPlugin.from_accelerate_config(RECIPES / "distca.yaml")
    assert plugin.resolved().tolerance == "auto" and plugin.server_group == "data_parallel"


# -- topology ------------------------------------------------------------------------------------


def _brute_force_groups(dp, pp, tp):
    """Ranks enumerated pipeline-major, tensor-minor; groups by the coordinates they share."""
    coordinates = list(itertools.product(range(pp), range(dp), range(tp)))  # rank = index

    def group_by(key):
        groups = {}
        for rank, (p, d, t) in enumerate(coordinates):
            groups.setdefault(key(p, d, t), []).append(rank)
        return sorted(groups.values())

    return {"data": group_by(lambda p, d, t: (p, t)), "tensor": group_by(lambda p, d, t: (p, d)),
            "pipeline": group_by(lambda p, d, t: (d, t)), "coordinates": coordinates}


@settings(max_examples=80, deadline=None)
@given(dp=st.integers(1, 5), pp=st.integers(1, 4), tp=st.integers(1, 4))
def test_topology_groups_match_brute_force(dp, pp, tp):
    world = dp * pp * tp
    topology = ParallelTopology(world, None, pp, tp)
    assert topology.data_parallel == dp
    expected = _brute_force_groups(dp, pp, tp)
    assert sorted(topology.data_parallel_groups()) == expected["data"]
    assert sorted(topology.tensor_parallel_groups()) == expected["tensor"]
    assert sorted(topology.pipeline_parallel_groups()) == expected["pipeline"]
    assert topology.server_groups() == topology.data_parallel_groups()
    for rank, (p, d, t) in enumerate(expected["coordinates"]):
        assert topology.coordinates(rank) == (d, p, t)
        server = topology.group_of(rank, topology.server_groups())
        assert all(topology.coordinates(r)[1:] == (p, t) for r in server)  # same stage, same tensor index
    for group in topology.tensor_parallel_groups():
        assert group == list(range(group[0], group[0] + tp))  # neighbours: one node


@settings(max_examples=40, deadline=None)
@given(dp=st.integers(1, 8), tp=st.integers(1, 3), per_node_factor=st.integers(1, 4))
def test_node_scope_cuts_server_groups_at_node_boundaries(dp, tp, per_node_factor):
    world = dp * tp
    per_node = min(world, tp * per_node_factor)
    if world % per_node:
        return
    topology = ParallelTopology(world, dp, 1, tp, ranks_per_node=per_node)
    node_groups = topology.server_groups("node")
    assert sorted(r for g in node_groups for r in g) == list(range(world))
    for group in node_groups:
        assert len({r // per_node for r in group}) == 1
        parent = topology.group_of(group[0], topology.data_parallel_groups())
        assert set(group) <= set(parent)
        assert set(group) == {r for r in parent if r // per_node == group[0] // per_node}


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, data_parallel=2, pipeline_parallel=2, tensor_parallel=2),
     r"2 x 2 x 2 = 8, but the world size is 6"),
    (dict(world_size=6, pipeline_parallel=4), r"world size 6 is not divisible by pipeline_parallel x tensor_parallel"),
    (dict(world_size=0), r"world_size must be an integer >= 1"),
    (dict(world_size=4, tensor_parallel=0), r"tensor_parallel must be an integer >= 1"),
    (dict(world_size=6, ranks_per_node=4), r"not a multiple of ranks_per_node"),
])
def test_topology_errors_are_specific(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelTopology(**kwargs)


def test_group_ranks_of_one_rank():
    from distca_hf.training.topology import group_ranks

    # 16 ranks: 2 pipeline stages x 4 data-parallel x 2 tensor-parallel; rank 11 = stage 1, dp index 1, tp index 1
    groups = group_ranks(16, 11, pipeline_parallel=2, tensor_parallel=2)
    assert groups == {"data": [9, 11, 13, 15], "pipeline": [3, 11], "tensor": [10, 11], "server": [9, 11, 13, 15]}
    assert group_ranks(16, 11, pipeline_parallel=2, tensor_parallel=2, scope="node", ranks_per_node=4)["server"] \
        == [9, 11]
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 16\)"):
        group_ranks(16, 16, tensor_parallel=2)


def test_plugin_topology_and_node_scope_need_consistent_sizes():
    with pytest.raises(ValueError, match="but the world size is 4"):
        DistCAPlugin(data_parallel_size=3).topology(4)
    with pytest.raises(ValueError, match="needs ranks_per_node"):
        ParallelTopology(4).server_groups("node")
    assert DistCAPlugin(tensor_parallel_size=2).topology(8).server_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]


# -- process groups on real ranks ----------------------------------------------------------------


def _groups_worker(rank, world, tensor_parallel):
    import torch.distributed as dist

    import distca_hf
    from helpers import tiny_model

    groups = DistCAPlugin(tensor_parallel_size=tensor_parallel, tolerance=0.05).attach()
    total = torch.tensor([rank])
    dist.all_reduce(total, group=groups.group)  # sums over this rank's server group only
    g = torch.Generator().manual_seed(rank)
    lengths = [[40], [3, 5, 7], [9, 2, 30], [1, 1, 20]][rank]
    docs = [torch.randint(0, 96, (n,), generator=g) for n in lengths]
    model = tiny_model("llama").eval()
    with torch.no_grad():
        ids = torch.cat(docs).unsqueeze(0)
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        packed = model(input_ids=ids, position_ids=pos).logits[0]
        stats = distca_hf.plan_stats()
        model.set_attn_implementation("eager")
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    return {"server_ranks": list(groups.server_ranks), "group_sum": int(total), "err": float((packed - alone).abs().max()),
            "local": stats["attn_pairs_local"], "dispatched": stats["dispatched"],
            "group_size": dist.get_world_size(groups.group)}


@pytest.mark.distributed
def test_tensor_parallel_server_groups_on_four_ranks(tmp_path):
    results = run_ranks(_groups_worker, 4, tmp_path, 2)
    for rank, result in enumerate(results):
        assert result["ok"], f"rank {rank}: {result.get('traceback', result['error'])}"
        value = result["value"]
        expected = [0, 2] if rank % 2 == 0 else [1, 3]  # ranks sharing a tensor-parallel index
        assert value["server_ranks"] == expected and value["group_size"] == 2
        assert value["group_sum"] == sum(expected)
        assert value["dispatched"] and len(value["local"]) == 2  # planned over the two-rank group
        assert value["err"] < 1e-5


# -- launch checks ---------------------------------------------------------------------------------


def test_launched_world_size_reads_the_accelerate_command(monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = tmp_path / "cfg.yaml"
    config.write_text("num_processes: 4\n")
    cases = [
        (["python", "/venv/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "train.py", "--x"], 2),
        (["accelerate", "launch", "--num-processes=3", "train.py"], 3),
        (["accelerate", "launch", "--config_file", "cfg.yaml", "train.py", "--num_processes", "9"], 4),
        (["torchrun", "train.py"], None),
    ]
    for argv, expected in cases:
        monkeypatch.setattr(processes, "parent_command", lambda argv=argv: (argv, str(tmp_path)))
        assert launch_module.launched_world_size()[0] == expected, argv
    monkeypatch.setattr(processes, "parent_command",
                        lambda: (["accelerate", "launch", "--cpu", "--num_processes", "2", "t.py"], None))
    with pytest.raises(launch_module.LaunchError, match=r"asked for 2 processes .* runs alone .*recipes/cpu-2proc.yaml"):
        launch_module.check_world_size(1)
    launch_module.check_world_size(2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(launch_module.LaunchError, match=r"asked for 4 processes \(WORLD_SIZE\) but the process group has 2"):
        launch_module.check_world_size(2)


def test_processes_joined_but_accelerate_set_up_alone_are_stopped(monkeypatch):
    """A plain Trainer on CPU processes without use_cpu=True: torch.distributed joins them, Accelerate
    counts one, so each would train alone on the same examples; the first distca forward stops it,
    naming the flag. Accelerate set up for every process, or not at all (a loop of one's own), passes."""
    from accelerate.state import PartialState

    monkeypatch.setattr(PartialState, "_shared_state", {"num_processes": 1, "distributed_type": "NO"})
    with pytest.raises(launch_module.LaunchError, match=r"runs 2 processes but Accelerate .*\(use_cpu=True\)"):
        processes.refuse_accelerate_alone(2)
    processes.refuse_accelerate_alone(2)  # checked once per process: the forward calls it every time
    for shared, world in (({"num_processes": 2}, 2), ({}, 2), ({"num_processes": 1}, 1)):
        reset_state()
        monkeypatch.setattr(PartialState, "_shared_state", shared)
        processes.refuse_accelerate_alone(world)
    # a forward before Accelerate is set up (the Trainer made later) leaves the check to the next one
    reset_state()
    monkeypatch.setattr(PartialState, "_shared_state", {})
    processes.refuse_accelerate_alone(2)
    monkeypatch.setattr(PartialState, "_shared_state", {"num_processes": 1})
    with pytest.raises(launch_module.LaunchError):
        processes.refuse_accelerate_alone(2)


@pytest.mark.distributed
def test_accelerate_launch_cpu_starting_one_process_fails_loudly(tmp_path):
    script = tmp_path / "check.py"
    script.write_text("from distca_hf.training.launch_checks import check_world_size\ncheck_world_size(1)\nprint('NOT STOPPED')\n")
    accelerate = Path(sys.executable).parent / "accelerate"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    result = subprocess.run([str(accelerate), "launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
                             "--mixed_precision", "no", "--dynamo_backend", "no", str(script)],
                            capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode != 0
    assert "NOT STOPPED" not in result.stdout
    assert "LaunchError: the launch asked for 2 processes (accelerate launch --num_processes 2)" in result.stderr


# -- the topology said the HF way: accelerate's ParallelismConfig, transformers' tensor parallelism ------------


def test_parallelism_config_gives_the_sizes():
    from accelerate import ParallelismConfig

    plugin = DistCAPlugin.from_parallelism_config(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, tp_size=2),
                                                  tolerance=0.1)
    topology = plugin.topology(8)
    # dp_replicate x dp_shard: both data-parallel for attention; the server groups share a tensor index
    assert (topology.data_parallel, topology.tensor_parallel) == (4, 2)
    assert topology.server_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert plugin.resolved().tolerance == 0.1
    with pytest.raises(ValueError, match="but the world size is 4"):
        plugin.topology(4)  # the config covers 8 ranks
    # the same size said twice is fine; accelerate's default config (sizes all 1) says nothing
    assert DistCAPlugin.from_parallelism_config(ParallelismConfig(dp_shard_size=2, tp_size=2),
                                                tensor_parallel_size=2).topology(4).tensor_parallel == 2
    assert DistCAPlugin.from_parallelism_config(ParallelismConfig()).topology(4).data_parallel == 4


@pytest.mark.parametrize("sizes, message", [
    (dict(dp_shard_size=2, cp_size=2), r"cp_size=2: context parallelism .* span_ranks replaces it, exactly and balanced"),
    (dict(dp_shard_size=2, sp_size=2), r"sp_size=2: sequence parallelism \(DeepSpeed ALST/Ulysses\)"),
])
def test_context_and_sequence_parallelism_are_refused_pointing_at_span_ranks(sizes, message):
    import dataclasses

    from accelerate import ParallelismConfig

    missing = sorted(set(sizes) - {f.name for f in dataclasses.fields(ParallelismConfig)})
    if missing:  # (accelerate 1.10 has no sp_size)
        pytest.skip(f"this accelerate release's ParallelismConfig has no {', '.join(missing)}")
    with pytest.raises(ValueError, match=message) as error:
        DistCAPlugin.from_parallelism_config(ParallelismConfig(**sizes))
    assert "DistCAPlugin(span_ranks=True), DISTCA_SPAN_RANKS=1 or span_ranks: true" in str(error.value)


def test_sizes_given_two_ways_must_agree_and_the_error_names_both():
    from accelerate import ParallelismConfig

    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    with pytest.raises(ValueError, match=r"tensor-parallel size is given two ways that disagree: "
                                         r"DistCAPlugin.tensor_parallel_size = 4, but DistCAPlugin.parallelism_config"
                                         r".tp_size = 2"):
        DistCAPlugin.from_parallelism_config(config, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"DistCAPlugin.data_parallel_size = 1, but DistCAPlugin.parallelism_config "
                                         r"dp_replicate_size x dp_shard_size \(1 x 2\) = 2"):
        DistCAPlugin.from_parallelism_config(config, data_parallel_size=1)
    # the Accelerator's config joins a plugin that has none; one of its own must agree with it
    assert DistCAPlugin().with_parallelism(config).topology(4).tensor_parallel == 2
    with pytest.raises(ValueError, match=r"DistCAPlugin.tensor_parallel_size = 1, but the ParallelismConfig of the "
                                         r"Accelerator.tp_size = 2"):
        DistCAPlugin(tensor_parallel_size=1).with_parallelism(config)
    with pytest.raises(ValueError, match=r"parallelism_config.tp_size = 4, but the ParallelismConfig of the "
                                         r"Accelerator.tp_size = 2"):
        DistCAPlugin.from_parallelism_config(ParallelismConfig(dp_shard_size=2, tp_size=4)).with_parallelism(config)


def test_a_tensor_parallel_model_says_its_size():
    """transformers 5 keeps the size in ``model._tp_size`` (``tp_size``) and ``config.distributed_config``
    (``from_pretrained(distributed_config=DistributedConfig(tp_size=..))``); a model not sharded says nothing."""
    from types import SimpleNamespace

    import inspect

    from transformers.distributed import DistributedConfig

    from distca_hf.training.plugin import ParallelSizes, model_parallel_sizes

    if "tp_size" not in inspect.signature(DistributedConfig).parameters:
        pytest.skip("this transformers release's DistributedConfig has no tp_size")

    from helpers import tiny_model

    model = tiny_model("llama")
    assert model_parallel_sizes(model) == ParallelSizes(data_parallel=None, tensor_parallel=None)
    assert DistCAPlugin().topology(4, model=model).tensor_parallel == 1
    model._tp_size = 2
    model.config.distributed_config = DistributedConfig(tp_size=2, fsdp_size=2)
    model._device_mesh = object()  # sharded at load time: the DistributedConfig's data sizes hold too
    assert model_parallel_sizes(model) == ParallelSizes(data_parallel=2, tensor_parallel=2)
    assert DistCAPlugin().topology(4, model=model).server_groups() == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match=r"DistCAPlugin.tensor_parallel_size = 4, but the model's tensor-parallel "
                                         r"size \(LlamaForCausalLM.tp_size\) = 2"):
        DistCAPlugin(tensor_parallel_size=4).topology(8, model=model)
    with pytest.raises(ValueError, match=r"data_parallel_size = 4, but the model's DistributedConfig"):
        DistCAPlugin(data_parallel_size=4).topology(8, model=model)
    legacy = SimpleNamespace(tp_size=None, config=SimpleNamespace(distributed_config={"tp_size": 4}))
    assert model_parallel_sizes(legacy).tensor_parallel == 4  # a config stored as a dict (from a saved config.json)


def test_parallelism_config_is_not_a_yaml_key(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("distca:\n  parallelism_config: {tp_size: 2}\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['parallelism_config'\]"):
        DistCAPlugin.from_accelerate_config(path)


def test_the_cpu_copy_of_a_parallelism_config_keeps_every_field_of_the_installed_accelerate():
    """``parallelism_config_for_cpu`` copies the config field by field: it read a fixed list of 1.15's
    fields (``cp_backend``, ``sp_size``...), and on accelerate 1.10, which has fewer, every tensor-parallel
    run on CPU processes failed with AttributeError."""
    import dataclasses

    from accelerate import ParallelismConfig

    from distca_hf.training.accelerator import CPUParallelismConfig, parallelism_config_for_cpu

    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    copy = parallelism_config_for_cpu(config)
    assert isinstance(copy, CPUParallelismConfig)
    assert {f.name: getattr(copy, f.name) for f in dataclasses.fields(config) if f.init} == \
        {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    assert parallelism_config_for_cpu(config, tp_size=4).tp_size == 4  # sizes given beside it win


def _unapplied_tensor_parallel_worker(rank, world):
    import warnings

    from accelerate import ParallelismConfig

    from distca_hf import DistCAAccelerator
    from helpers import tiny_model

    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    accelerator = DistCAAccelerator(distca_plugin=DistCAPlugin.from_parallelism_config(ParallelismConfig(tp_size=2)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.prepare(tiny_model("llama"))
    return {"server_ranks": list(accelerator.distca.server_ranks), "warnings": [str(w.message) for w in caught]}


@pytest.mark.distributed
def test_a_tensor_parallel_size_that_shards_nothing_is_warned_about(tmp_path):
    """A tensor-parallel size given to distca alone: Accelerate runs plain data parallelism (the model is
    whole on each rank) and distca's server groups hold one rank each here, so nothing is balanced; said,
    naming where to give the size (silent before)."""
    for result in run_ranks(_unapplied_tensor_parallel_worker, 2, tmp_path):
        assert result["ok"], result.get("traceback", result.get("error"))
        value = result["value"]
        assert len(value["server_ranks"]) == 1
        assert any("tensor_parallel=2, but neither the model nor the Accelerator is sharded so" in w
                   for w in value["warnings"]), value["warnings"]


def test_a_node_server_group_needs_a_local_world_size_that_divides_the_world(monkeypatch):
    """``server_group='node'`` read a LOCAL_WORLD_SIZE that does not divide the world (or is no number) as
    one node of the whole world, without a word."""
    for bad in ("3", "two", "0"):  # one process: a world of 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=f"server_group='node' needs LOCAL_WORLD_SIZE .* got LOCAL_WORLD_SIZE='{bad}'"):
            DistCAPlugin(server_group="node").attach()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert list(DistCAPlugin(server_group="node").attach().server_ranks) == [0]
