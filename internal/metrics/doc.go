// Package metrics is stor's Prometheus instrumentation: one registry per
// process, the HTTP handler that serves it beside the health endpoints,
// and the collectors of each process's state.
//
// # The listener
//
// stor-server --metrics-listen, stor-csi --metrics-listen (the same
// listener as --health-listen) and stor-ctl nbd serve/attach
// --metrics-listen serve Handler:
//
//	/metrics  the registry in the Prometheus text format
//	/healthz  200 while the process serves (liveness; never asks the cluster)
//	/readyz   200 when the process can do its work, 503 with the reason
//	          otherwise (server: a Raft member that knows its leader; CSI
//	          controller: the cluster answers with a leader; CSI node:
//	          registered and its staged volumes recovered)
//
// The listener is plain HTTP with no authentication, so it is off unless a
// flag names an address; deploy/ binds it on the pod network for the
// kubelet's probes and Prometheus.
//
// # Naming
//
// Every series starts with stor_; counters end in _total, durations are
// _seconds histograms, sizes _bytes. The series (labels in braces):
//
//	stor_raft_state{state}                   1 for this server's Raft state, 0 for the others
//	stor_raft_term, stor_raft_commit_index, stor_raft_applied_index, stor_raft_last_index
//	stor_raft_has_leader                     1 if this server knows a leader
//	stor_raft_leader_changes_total           leader changes this server observed
//	stor_raft_apply_duration_seconds         propose-to-applied latency of this leader's proposals
//	stor_server_capacity_bytes{server}       (leader only) what each server offers replicas
//	stor_server_allocated_bytes{server}      (leader only) bytes promised to the replicas placed there
//	stor_server_up{server}                   (leader only) 1 up, 0 down
//	stor_server_cordoned{server}             (leader only) 1 cordoned
//	stor_replicas{state}                     (leader only) replicas by state, over every volume
//	stor_volumes{state}                      (leader only) volumes by state
//	stor_rebuilds{server}                    (leader only) replicas rebuilding onto each server
//	stor_rebuild_remaining_bytes{server}     (leader only) bytes the rebuilds onto each server have to copy
//	stor_rebuild_done_bytes{server}          (leader only) bytes they copied; deriv() of it is the rate
//	stor_disk_total_bytes, stor_disk_used_bytes   the filesystem of this server's data dir
//	stor_data_connections                    replica data port connections served now
//	stor_data_connections_total, stor_data_connections_refused_total
//	stor_data_requests_failed_total{status}  data requests answered with an error (stale_epoch, denied, ...)
//	stor_api_rpcs_total{method,code}, stor_api_rpc_duration_seconds{method}   control API calls (server)
//	stor_csi_rpcs_total{method,code}, stor_csi_rpc_duration_seconds{method}   CSI calls (stor-csi)
//	stor_volume_ops_total{volume,op}         engine I/O served to NBD, per attached volume
//	stor_volume_bytes_total{volume,op}
//	stor_volume_errors_total{volume,op}
//	stor_volume_op_duration_seconds{volume,op}   read, write and flush latency
//	stor_volume_inflight_ops{volume}
//	stor_volume_rebuild_copied_bytes_total{volume}   bytes the engine copied into rebuilding replicas; rate() is the rebuild rate
//	stor_volume_rebuild_remaining_bytes{volume}      bytes its running rebuilds have left
//	stor_nbd_connections{volume}             NBD connections to the volume's export
//
// # Cardinality at 10k volumes
//
// No series is labelled by a volume on a server: the leader publishes the
// cluster's volumes and replicas as counts by state and sums per server
// (stor_server_*, stor_rebuild_* carry only a server label), so a server's
// series grow with the number of servers, not of volumes. Per-volume
// series (stor_volume_*, stor_nbd_connections) exist only in the process
// that has the volume attached (a CSI node plugin, stor-ctl nbd), only
// while it is attached: Volumes.Add creates them, the remove function it
// returns deletes them at detach. A node serves at most its --max-volumes
// (the nbd module's device count), so a node plugin's series are bounded
// by that, whatever the size of the cluster. Label values come from
// bounded sets only: states, op names, gRPC method names and codes, wire
// statuses, server ids and attached volume names.
//
// Cluster-wide series come from the leader only so that a sum over every
// server counts each volume once; a follower publishes its own Raft,
// disk and data-port series.
package metrics
