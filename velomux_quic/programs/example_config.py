"""The commented sample configuration ``velomux node --example-config`` prints.

Every key the node's loader reads, set to its default, with a comment saying what it
does. It is a string in the package, not a file of the checkout, so an installed wheel
prints it; ``examples/node.toml`` in the sources is the same text (a test keeps them
equal, and another that it loads).
"""

from __future__ import annotations

__all__ = ["EXAMPLE_CONFIG"]

EXAMPLE_CONFIG = """\
# A node's configuration: every key velomux reads, each set to its default.
#
#   velomux node --example-config > node.toml        # write this file
#   velomux node --config node.toml                  # run one node as a service
#   NodeConfig.from_toml("node.toml")                 # the same, in a program
#
# Every key is optional (an absent key takes the default shown). Any key can be
# overridden from the environment as VELOMUX_<SECTION>_<KEY>, parsed as the key's
# type: VELOMUX_NODE_PORT=7000, VELOMUX_TRANSPORT_LANES=4, VELOMUX_MUX_MUX_ONLY=true,
# VELOMUX_TRANSPORT_MAX_PARTIAL_FRAME_BYTES=none (back to absent); VELOMUX_MUX_DISABLE=1
# runs the node without the mux. The operations guide ("Configuration reference")
# says what each key does; the layer's config class
# (TransportConfig, MessengerConfig, StreamingConfig, MuxConfig) documents each field.

[node]
# Directory with node.pem, node.key, ca.pem and node.json (velomux certs dev makes one);
# relative to the working directory.
credentials = "certs/dev/node-a"
# Address and UDP port the node listens on (port 0: any free port).
host = "127.0.0.1"
port = 0
# Label in records and logs; "" takes the name in the credentials.
name = ""
# A directory shared by the nodes of one host, for discovery (DirectoryPeers); the
# same as [discovery] backend = "directory" below (set one of the two, not both).
# Absent: no discovery, only the [[peers]] below.
# peer_directory = "/run/velomux/peers"

# Peers known from the start, one table each (none by default):
# [[peers]]
# instance_id = "6f1c2a4e-0b7d-4c55-9a43-2f8e1d0c9b11"   # the UUID in its certificate
# address = "10.0.0.2:7000"                              # host:port
# name = "engine-0"                                      # a label, optional


[discovery]  # DiscoveryConfig: how the node finds the others
# "none" (static peers only), "directory" (DirectoryPeers on `directory`, one host) or
# "etcd" (EtcdPeers: a leased key per node on an etcd v3 cluster, watched).
backend = "none"
# directory = "/run/velomux/peers"   # backend = "directory" only
# etcd members, host:port each, tried in turn (VELOMUX_DISCOVERY_ETCD_ENDPOINTS=a:2379,b:2379).
etcd_endpoints = ["127.0.0.1:2379"]
# Each node's record is the key <etcd_prefix>/<instance-uuid>.
etcd_prefix = "/velomux/nodes"
# Seconds of the record's lease: how long a node killed without closing stays listed.
lease_ttl = 10
# TLS to etcd: the CA that signed etcd's certificate, and a client certificate and key
# for an etcd run with --client-cert-auth. Absent: plaintext.
# etcd_ca = "/etc/velomux/etcd-ca.pem"
# etcd_cert = "/etc/velomux/etcd-client.pem"
# etcd_key = "/etc/velomux/etcd-client.key"


[transport]  # TransportConfig
lanes = 1
# engine = "qh3"  (absent: VELOMUX_QUIC_ENGINE, else "aioquic"; qh3 needs velomux_quic[qh3])
max_message_size = 16777216  # 16 MiB
# max_datagram_size = 1452  (absent: per path; set, one size for every connection)
pmtu_discovery = true
pmtu_max = 8972
loopback_datagram_size = 16384  # 16 KiB
idle_timeout = 15.0
keep_alive_interval = 5.0
handshake_timeout = 5.0
# Warn (a certificate_expiring event) this many seconds before the node certificate or a
# trusted CA expires; 0: never (velo_node_certificate_expiry_seconds is exported anyway).
certificate_expiry_warning = 1209600.0
max_half_open_handshakes = 256
retry_threshold = 32
max_half_open_per_source = 32
half_open_idle_timeout = 2.0
lane_window = 1048576  # 1 MiB
stream_window = 65536  # 64 KiB
send_buffer = 1048576  # 1 MiB
streams_send_buffer = 262144  # 256 KiB
connection_window = 16777216  # 16 MiB
max_concurrent_streams = 4096
max_connections_per_peer = 4
# max_partial_frame_bytes = ...  (absent: twice max_message_size, 32 MiB)
partial_frame_timeout = 30.0
max_stream_openings = 256
max_stream_opening_size = 1024  # 1 KiB
stream_opening_timeout = 10.0
udp_receive_buffer = 8388608  # 8 MiB
udp_send_buffer = 4194304  # 4 MiB
close_timeout = 1.0
health_check_timeout = 5.0

[messenger]  # MessengerConfig
default_timeout = 30.0
staging_threshold = 262144  # 256 KiB
staged_payload_max = 67108864  # 64 MiB
max_staged_bytes = 1073741824  # 1024 MiB
staged_ttl = 60.0
pull_timeout = 60.0
release_timeout = 10.0
max_pulls_per_peer = 1024
max_releases_per_peer = 16
max_pull_bytes_per_peer = 268435456  # 256 MiB
max_pending_reply_bytes = 4194304  # 4 MiB
health_check_timeout = 5.0
max_ordered_backlog = 65536

[streaming]  # StreamingConfig
heartbeat_interval = 5.0
attach_timeout = 10.0
per_stream_window = 65536  # 64 KiB
per_stream_send_buffer = 65536  # 64 KiB
anchor_capacity = 256
close_flush_timeout = 5.0

[mux]  # MuxConfig
enabled = true
mux_only = false
max_batch_bytes = 61440  # 60 KiB
initial_credit = 32
credit_return_below = 0.5
slot_byte_budget = 1048576  # 1 MiB
peer_byte_budget = 8388608  # 8 MiB
peer_queue_bytes = 2097152  # 2 MiB per (peer, lane): what producers stage before send() waits
credit_sweep_interval = 0.2
drain_visit_floor = 0.002
batcher_idle_ttl = 60.0
reply_linger = 0.001
async_open_ack = false
max_slots_per_table = 65536
reject_lane_cap = 8192
max_refused_slots = 4096
health_check_interval = 5.0
health_check_timeout = 5.0
prebind_timeout = 180.0

[mux.flush_policy]  # AutoFlush ("auto") or Manual ("manual", which has no other keys)
kind = "auto"
on_admission = true
# max_linger = ...  (absent: no linger window)
on_complete = false
# at_bytes = ...  (absent: no byte threshold)
"""
