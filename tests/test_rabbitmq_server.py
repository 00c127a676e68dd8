"""The private RabbitMQ node of tests/servers.py: its own name, ports on loopback and
cookie, so tests never touch the machine's node, and its CLI reaches it."""

from __future__ import annotations


def test_the_private_node_listens_on_its_own_loopback_ports(rabbitmq_server):
    overview = rabbitmq_server.api("GET", "overview")
    assert overview["node"] == rabbitmq_server.nodename
    listeners = {(row["protocol"], row["port"]): row["ip_address"] for row in overview["listeners"]}
    assert set(listeners) == {("amqp", rabbitmq_server.port), ("http", rabbitmq_server.api_port),
                              ("clustering", rabbitmq_server.dist_port)}
    # The management plugin reports its own listener as '::' whatever address it binds.
    assert listeners[("amqp", rabbitmq_server.port)] == "127.0.0.1"
    assert listeners[("clustering", rabbitmq_server.dist_port)] == "127.0.0.1"
    # rabbitmqctl finds the node's cookie in the node's HOME, and sees what the API sees.
    header, *vhosts = rabbitmq_server.rabbitmqctl("list_vhosts").split()
    assert header == "name" and "/" in vhosts
    assert set(vhosts) == {row["name"] for row in rabbitmq_server.api("GET", "vhosts")}
