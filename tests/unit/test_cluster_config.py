"""The NATS cluster configurations: ``ops/nats/`` is what :mod:`stack.cluster` writes, and reads back."""

from pathlib import Path

from stack import cluster

OPS = Path(__file__).resolve().parents[2] / "ops" / "nats"


def test_the_checked_in_configs_are_the_generated_ones():
    for node in cluster.DEFAULT_NODES:
        assert (OPS / f"{node.name}.conf").read_text() == cluster.render(node, cluster.DEFAULT_NODES), node.name


def test_each_node_routes_to_the_others_and_reads_back(tmp_path):
    nodes = [cluster.Node(f"n{i}", 5000 + i, 6000 + i, 7000 + i) for i in (1, 2, 3)]
    paths = cluster.write(tmp_path, nodes)
    assert [p.name for p in paths] == ["n1.conf", "n2.conf", "n3.conf"]
    text = paths[0].read_text()
    assert "listen: 127.0.0.1:5001" in text and 'store_dir: "n1"' in text
    assert "nats-route://127.0.0.1:6002" in text and "nats-route://127.0.0.1:6003" in text
    assert "nats-route://127.0.0.1:6001" not in text  # no route to itself
    assert cluster.read(tmp_path) == nodes
    assert cluster.urls(nodes) == "nats://127.0.0.1:5001,nats://127.0.0.1:5002,nats://127.0.0.1:5003"


def test_the_command_line_says_what_is_missing(tmp_path, capsys):
    assert cluster.main(["urls", str(tmp_path)]) == 2
    assert "no n*.conf" in capsys.readouterr().err
    assert cluster.main(["write", str(tmp_path)]) == 0
    assert cluster.main(["urls", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("nats://127.0.0.1:4224")
