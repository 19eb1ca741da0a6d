"""More than one host: two network namespaces joined by a veth pair (tests/support/two_hosts.py), each host's
commands in a pid namespace of its own. Both hosts' names resolve to loopback, so a rank that advertises its
host name's address (gloo's default) is refused by the other host: the ranks must use the interface toward
MASTER_ADDR (engine/network.py; engine/launch.py for a recipe's infer.sh, npu_standin/dist.py under the
stand-in). Each run's rank 0 text is the one-host run's.

The default set runs a recipe's own infer.sh (one rank per host); `-m slow` runs the same with the user's
GLOO_SOCKET_IFNAME=lo kept (the failure this guards against: connectFullMesh refused), and a framework recipe
through upstream's launcher over its `IPs` list at the smallest layouts it spreads over two servers: 16 ranks
(8 a server, a 950-class YAML) and 32 (16 a server, A2/A3)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from two_hosts import finish, start, two_hosts

MASTER_PORT = "29500"        # each pair of namespaces has its own ports


def _texts(log: Path) -> list[str]:
    return re.findall(r"Request 0: outputs: (.*)", log.read_text(errors="replace"))


def _why(outputs: list[str], res: Path) -> str:
    """A failed run's account, its cause last (a report keeps a message's end): each host's output tail,
    then every line of the hosts' outputs and the ranks' logs that names an error, without the launcher's
    own traceback."""
    logs = [path.read_text(errors="replace") for path in sorted(res.glob("node*/log_*.log"))]
    errors = [f"host{i}: {line.strip()}" for i, text in enumerate(outputs + logs) for line in text.splitlines()
              if re.search(r"Error|error:|Exception|refused|Timeout|timed out", line)
              and "elastic" not in line and "ChildFailedError" not in line]
    return "".join(f"--- host{i} ---\n{text[-1500:]}\n" for i, text in enumerate(outputs)) + \
        "--- error lines ---\n" + "\n".join(dict.fromkeys(errors))


def _recipe_env(yaml_file: Path, res: Path, node_rank: int, master: str, **extra) -> dict:
    return {**os.environ, "NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": master,
            "MASTER_PORT": MASTER_PORT, "YAML_FILE": f"config/{yaml_file.name}", "PYTHON": sys.executable,
            "RES_PATH": str(res / f"node{node_rank}"), "OMP_NUM_THREADS": "1", **extra}


def test_a_recipes_infer_sh_runs_one_rank_per_host_with_the_one_host_text(working_recipe, working_recipe_source,
                                                                           tmp_path):
    """NNODES=2 / NODE_RANK / MASTER_ADDR as the recipe's infer.sh documents them, tensor parallel over two
    hosts: each host's engine.launch names the interface toward MASTER_ADDR, rank 0 and rank 1 give the
    text of the migration's one-host run. A MASTER_ADDR with no route from a host is one line, exit 2."""
    from agent.recipe.recipe import Recipe

    single = _texts(next((working_recipe_source / ".migrator" / "runs").glob("run_*/log_0.log")))
    assert single
    yaml_file = Recipe.at(working_recipe).write_yaml_for(2)
    with two_hosts() as hosts:
        master = hosts[0].address
        unreachable = subprocess.run(hosts[0].command(["bash", "infer.sh"]), cwd=working_recipe, capture_output=True,
                                     text=True, timeout=120, env=_recipe_env(yaml_file, tmp_path, 0, "192.0.2.7"))
        nodes = [start(host, ["bash", "infer.sh"], tmp_path / f"host{rank}.out", cwd=working_recipe,
                       env=_recipe_env(yaml_file, tmp_path, rank, master))
                 for rank, host in enumerate(hosts)]
        outputs, timed_out = finish(nodes, 600)
    assert unreachable.returncode == 2, unreachable.stderr[-2000:]
    assert unreachable.stderr.strip().splitlines() == [
        "engine.launch: error: MASTER_ADDR='192.0.2.7': no route from this host (Network is unreachable): "
        "set MASTER_ADDR to node 0's address, reachable from every machine"]
    assert not timed_out and [n.returncode for n in nodes] == [0, 0], _why(outputs, tmp_path)
    for rank, host in enumerate(hosts):
        assert (f"engine.launch: toward MASTER_ADDR={master}: interface {host.interface} ({host.address}); "
                f"set GLOO_SOCKET_IFNAME={host.interface}") in outputs[rank]
        log = tmp_path / f"node{rank}" / f"log_{rank}.log"
        assert f"tensor parallel rank {rank} of 2" in log.read_text()
        assert _texts(log) == single


@pytest.mark.slow  # the harness's own check: test_a_recipes_infer_sh_runs_one_rank_per_host_… runs the path by default
def test_the_users_loopback_interface_is_kept_and_the_peer_is_refused(working_recipe, tmp_path):
    """What happens without the interface choice (gloo on the address the host name resolves to, loopback
    here): GLOO_SOCKET_IFNAME=lo, the user's, is kept, and the other host's rank is refused."""
    from agent.recipe.recipe import Recipe

    yaml_file = Recipe.at(working_recipe).write_yaml_for(2)
    with two_hosts() as hosts:
        nodes = [start(host, ["bash", "infer.sh"], tmp_path / f"host{rank}.out", cwd=working_recipe,
                       env=_recipe_env(yaml_file, tmp_path, rank, hosts[0].address, GLOO_SOCKET_IFNAME="lo"))
                 for rank, host in enumerate(hosts)]
        outputs, _ = finish(nodes, 300)
    both = "\n".join(outputs)
    assert "kept GLOO_SOCKET_IFNAME=lo" in both
    assert re.search(r"connectFullMesh failed .*Connection refused, remote=\[127\.0\.0\.1\]", both), both[-4000:]
    assert [n.returncode for n in nodes] != [0, 0]


# ---- a framework recipe through upstream's launcher ---------------------------------------------
MAX_NEW_TOKENS = 8


# The layouts (world_size, the YAML's changes): the one-host run is the same tensor-parallel split on one server
# (function.sh counts 16 chips on the stand-in's device, an A3 by its name), the others spread over two.
ONE_HOST = "hosts_16_one_server.yaml"
LAYOUTS = {
    ONE_HOST: (16, {}, {}),
    "hosts_16.yaml": (16, {"platform_version": "950"}, {}),                   # 8 chips a server: 8 + 8
    "hosts_32.yaml": (32, {}, {"attn_tp_size": 16, "lmhead_tp_size": 16}),    # 16 + 16: one TP group a server
}


@pytest.fixture(scope="module")
def framework_recipe(tmp_path_factory):
    """A tiny llama (16 heads: one a rank at 16-way tensor parallel) migrated natively into a copy of the
    snapshot, its YAMLs for the layouts, and the one-host text: 16 ranks on one server, under the stand-in,
    through upstream's launcher. The run's dtype is bfloat16 (upstream's executor's): a split of the
    reductions other than 16-way would round otherwise, so the one-host run is the same split."""
    from agent.measure import reference as upstream
    from agent.recipe.recipe import Recipe
    from agent.workflow.run import run_migration
    from migrator_cli import run_cli
    from upstream_checkout import copy_checkout

    root = tmp_path_factory.mktemp("hosts")
    checkpoint = upstream.tiny_checkpoint("llama", root / "ckpt", num_attention_heads=16, num_key_value_heads=2,
                                          head_dim=8)
    checkout = copy_checkout(root / "one_host")
    run_migration({"target": str(checkpoint), "output_dir": str(checkout / "models"), "name": "hosts_llama",
                   "device": "cpu", "max_new_tokens": MAX_NEW_TOKENS, "max_rounds": 0, "world_size": 1,
                   "recipe_target": "framework", "transformers_source": "installed"}, stop_after="render")
    recipe = Recipe.at(checkout / "models" / "hosts_llama")
    for name, (world_size, model_config, parallel) in LAYOUTS.items():
        data = yaml.safe_load(recipe.yaml_for(world_size, write=True).read_text())
        data["model_config"].update(model_path=str(checkpoint), exe_mode="eager", **model_config)
        data["parallel_config"].update(parallel)
        # one request a data-parallel group: each runs the default prompt
        data["scheduler_config"].update(max_new_tokens=MAX_NEW_TOKENS,
                                        batch_size=world_size // data["parallel_config"]["attn_tp_size"])
        (recipe.path / "config" / name).write_text(yaml.safe_dump(data, sort_keys=False))
    proc = run_cli("standin", "--", *upstream.framework_command(checkout, "hosts_llama", ONE_HOST),
                   cwd=root, timeout=1500, env={"OMP_NUM_THREADS": "1"})
    logs = upstream.rank_logs(checkout, "hosts_llama", ONE_HOST)
    assert proc.returncode == 0 and len(logs) == 16, proc.stdout[-2000:] + proc.stderr[-3000:]
    texts = {upstream.outputs(log).get(0) for log in logs}
    assert len(texts) == 1 and None not in texts, texts
    shutil.rmtree(recipe.path / "res")
    return {"root": root, "checkout": checkout, "text": texts.pop()}


def _server_checkout(framework_recipe, name: str, ips: tuple[str, ...]) -> Path:
    """A server's own checkout (as on two machines: each writes log_0.. of its own ranks), its
    executor/scripts/set_env.sh listing the servers' addresses, as upstream's README asks."""
    checkout = framework_recipe["root"] / name / "cann-recipes-infer"
    shutil.copytree(framework_recipe["checkout"], checkout, symlinks=True)
    set_env = checkout / "executor" / "scripts" / "set_env.sh"
    text = set_env.read_text()
    placeholder = "export IPs=('xx.xx.xx.xx' 'xx.xx.xx.xx')"
    assert placeholder in text, "upstream's set_env.sh no longer lists IPs as the tests expect"
    set_env.write_text(text.replace(placeholder, f"export IPs=({' '.join(repr(ip) for ip in ips)})"))
    return checkout


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


@pytest.mark.slow  # 16 or 32 ranks on 2 cores: minutes; the interface choice runs by default in
# test_a_recipes_infer_sh_runs_one_rank_per_host_… and tests/unit/npu_standin/test_rendezvous.py
@pytest.mark.parametrize("yaml_name, per_server, needs_gib", [("hosts_16.yaml", 8, 6), ("hosts_32.yaml", 16, 12)],
                         ids=["950-16ranks", "A3-32ranks"])
def test_a_framework_recipe_runs_across_two_servers_through_upstreams_launcher(framework_recipe, yaml_name,
                                                                            per_server, needs_gib):
    """`migrator standin -- bash executor/scripts/infer.sh --model M --yaml F` on each server, as upstream
    runs a model over two servers: function.sh counts 8 chips a 950-class server and 16 an A2/A3 one, so
    world_size 16 (950) and 32 (A3) are the smallest it spreads over two. At 16, tensor parallel over all
    ranks: every layer's reduction crosses the hosts; at 32, one 16-way group a server (the world group
    spans both). The ranks meet at IPs[0]:6038 over the veth interface; every rank's text is the one-host
    run's (the same 16-way split on one server)."""
    world_size = LAYOUTS[yaml_name][0]
    if _available_gib() < needs_gib:
        pytest.skip(f"{world_size} ranks need about {needs_gib} GiB of free memory; {_available_gib():.1f} here")
    from agent.measure import reference as upstream

    root = framework_recipe["root"]
    with two_hosts() as hosts:
        ips = tuple(host.address for host in hosts)
        servers = [_server_checkout(framework_recipe, f"{world_size}_server{i}", ips) for i in range(2)]
        records = [root / f"record_{world_size}_{i}" for i in range(2)]
        nodes = [start(host, [sys.executable, "-m", "agent.cli", "standin", "--record", str(records[i]), "--",
                              *upstream.framework_command(servers[i], "hosts_llama", yaml_name)],
                       root / f"server_{world_size}_{i}.out", cwd=servers[i], env={**os.environ, "OMP_NUM_THREADS": "1"})
                 for i, host in enumerate(hosts)]
        outputs, timed_out = finish(nodes, 1500)
    assert not timed_out and [n.returncode for n in nodes] == [0, 0], _why(outputs, tmp_path)
    for i, host in enumerate(hosts):
        logs = upstream.rank_logs(servers[i], "hosts_llama", yaml_name)
        assert [log.name for log in logs] == [f"log_{r}.log" for r in range(per_server)]
        assert {upstream.outputs(log).get(0) for log in logs} == {framework_recipe["text"]}, logs[0].read_text()[-3000:]
        usage = json.loads((records[i] / "standin_usage.json").read_text())
        assert usage["ranks"] == list(range(i * per_server, (i + 1) * per_server))
        note = usage["notes"]["rendezvous"]
        assert f"ranks on several hosts (world {world_size}, {per_server} here)" in note
        assert f"rendezvous at {ips[0]}:6038" in note and f"interface {host.interface} ({host.address})" in note
