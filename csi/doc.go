// Package csi is stor's CSI driver (CSI spec v1.13): the Identity,
// Controller and Node services behind cmd/stor-csi. It is the only
// place that chooses CSI error codes (errors.go holds the table).
//
// # Modes
//
// A Driver runs in one of three modes: "controller" (Identity +
// Controller, a client of the cluster API, run beside the CSI sidecars),
// "node" (Identity + Node, one per Kubernetes node: a volume engine and an
// NBD server per staged volume, the kernel NBD attachment) or "all" (both,
// for tests and single-host use).
//
// # Names, ids, sizes
//
// The driver name defaults to "csi.stor.io". A CSI volume id is the
// stor volume id; a CSI snapshot id is the stor snapshot id; a CSI volume
// name is the stor volume name (CreateVolume is idempotent by name, as
// the cluster is).
//
// Deleting a volume that has snapshots is OK (and OK again): snapshots
// outlive their volume, as Kubernetes assumes, so the cluster keeps the
// volume's data for them (raftstore, "Volume lifecycle") until the last
// is deleted, while for CSI the volume is gone: ControllerGetVolume,
// ControllerPublishVolume and CreateVolume or CreateSnapshot from it are
// NOT_FOUND, ListVolumes does not list it, its name may be used again,
// and CreateVolume from its snapshots still restores them.
//
// Capacity rounding: a requested capacity is rounded UP to a multiple of
// 4 KiB (4096 bytes, the cluster's and the kernel device's block size).
// No capacity range gives DefaultVolumeSize (1 GiB). A rounded size above
// limit_bytes is OUT_OF_RANGE; the largest volume is 1 PiB. csi-sanity's
// test size (10 GiB, expanded to 11 GiB) is a multiple of 4 KiB.
//
// StorageClass parameters (anything else is INVALID_ARGUMENT; keys with
// the prefix "csi.storage.k8s.io/" are the sidecars' and are ignored):
//
//	replicas   replica count, 1..7 (default 3)
//	fsType     ext4 (default) or xfs; the volume capability's fs_type wins
//
// # Topology
//
// Topology states what really constrains access: the zone. Any node can
// reach any volume over the network, so a node is never a constraint,
// only a wish for data locality.
//
// NodeGetInfo reports "topology.<driver name>/node" (the node id, the
// Kubernetes node name) and "topology.<driver name>/zone" (the node's
// zone, when it has one). The node key stays: it is how csi-provisioner
// tells CreateVolume the pod's selected node (without --strict-topology,
// deploy/'s setting, the requisite holds the segment of every node with
// the selected node's keys and the preferred list starts with the
// selected node's), and it gives every node its own CSIStorageCapacity.
//
// CreateVolume: the zones of the requisite restrict the replicas to those
// zones (none when a requisite segment has no zone); node segments and
// preferred zones are preferences, tried in order. Placement matches a
// "node" segment against each server's id and the Kubernetes node it runs
// on (stor-server --k8s-node, deploy/ passes spec.nodeName), so the
// selected node's server, if it runs one, gets the first replica (data
// locality). Too few servers or too little capacity in the requisite
// zones is RESOURCE_EXHAUSTED (the code that makes csi-provisioner
// reschedule). The accessible_topology returned (and in ListVolumes,
// ControllerGetVolume) is those zones, each once, or nothing: never a
// node key, which would pin the PV's nodeAffinity to the nodes of its
// birth and refuse every node added later.
//
// GetCapacity answers for a segment what a claim from a node with that
// segment can really get, since the scheduler rejects a node whose
// CSIStorageCapacity is below the claim: the servers are the up servers
// CreateVolume could use for it (a node key restricts nothing; a zone
// admits the zones of every registered node that has one, as the
// provisioner's requisite would; no zone admits every server), with the
// StorageClass's replica count. maximum_volume_size is the replicas-th
// largest free space among them; available_capacity the most volume bytes
// they hold together with each volume's replicas on distinct servers.
// A StorageClass with allowedTopologies narrower than that is answered
// too generously; CreateVolume then refuses with RESOURCE_EXHAUSTED and
// the provisioner reschedules.
//
// # Nodes
//
// The CSI node id is the Kubernetes node name (deploy/ passes
// $(NODE_NAME)); most such nodes run no stor-server. At start the node
// plugin registers itself with the cluster (ClusterService.RegisterNode:
// its node id, --zone and --max-volumes; an upsert, so a restart
// registers again),
// retrying with backoff while the cluster does not answer, before it is
// ready (/readyz); NodeGetInfo does not depend on it. An id the cluster
// refuses (not 1-253 letters, digits, '.', '_' or '-') is logged and
// /readyz stays not ready (staged volumes are still recovered). ControllerPublishVolume accepts a node id that is a
// registered node or a stor-server id (a server attaching volumes as a
// client, stor-ctl nbd attach); any other id is NOT_FOUND. Node records
// are never removed (stor-ctl node list shows them).
//
// # Attach, epochs, fencing
//
// ControllerPublishVolume attaches the volume to the node in the cluster
// (a Raft write that increments the volume's epoch); a volume attached
// to another node is FAILED_PRECONDITION (RWO and RWOP both mean one
// node here; RWOP also allows one publication on that node), a node
// with as many volumes published as the limit its node plugin registered
// (its own --max-volumes, NodeGetInfo's max_volumes_per_node; never a
// controller setting) is RESOURCE_EXHAUSTED; a node that registered no
// limit (a stor-server id) has none here. ControllerPublish to the node that already holds the volume
// with the same read-only flag is idempotent: it returns the same
// publish_context and does NOT attach again (no epoch bump that would
// fence the node's live engine); with the other read-only flag it is
// ALREADY_EXISTS. NodeStageVolume opens the volume engine, which attaches
// again from the same node (allowed, a new epoch: it fences any earlier
// engine of this node), serves it on socket pairs and connects a kernel
// /dev/nbdN (package internal/attach). NodeUnstageVolume flushes, detaches
// the device and closes the engine but leaves the cluster attachment;
// ControllerUnpublishVolume removes it. After ControllerUnpublish from A
// and ControllerPublish to B, B's epoch is higher: A's engine, if still
// running, can no longer write to any replica. An engine so fenced stops
// and disconnects its device (the requests still in it fail), and a device
// left by a plugin that died is resumed only while the volume is still at
// the epoch its record names: no later stage of the volume on A resumes a
// device holding requests of an engine the volume has left, which the
// kernel would resend over what was written since. NodeUnstageVolume
// releases whatever a stop left (internal/attach.Release) and fails while
// the device is in use; it unmounts the staging path even without a
// staged record. A repeated NodeStageVolume that fails detaches nothing it
// did not attach, and a block NodePublishVolume requires the volume served
// on its staged device. A mount NodePublishVolume publishes only a
// staging path mounted from the device that serves the volume now: it
// waits (up to 5 s) for an engine the volume has left to stop, serves the
// volume if it is not served, and mounts the staging path again when it
// is mounted from another device (fenced here, then published here again:
// the kubelet, which takes it for staged, does not stage it again) or not
// mounted at all (after a reboot; never the bare directory, which is the
// node's root disk).
//
// The node plugin checks at New (with the kernel's attacher) that it
// reaches the kernel's nbd netlink family, and fails otherwise: a kernel
// before 6.3 hides the family from every network namespace but the
// host's (nbd/kernel.ErrNetNamespace), so the plugin must run with
// hostNetwork; deploy/'s DaemonSet does. Failing at start puts the reason
// in the container's log; a plugin that started would register, report
// ready and fail every NodeStageVolume.
//
// The node plugin serves its own node's writeback to /dev/nbdN: Start
// first sets PR_SET_IO_FLUSHER and a low oom_score_adj on the process
// (internal/attach.PrepareProcess; refusals are logged, not fatal).
//
// Restart recovery: the node plugin records every staged volume in
// --state-dir (staged/<volume id>.json, beside internal/attach's device
// records in nbd/). On start it resumes every recorded device before it
// reports ready (/readyz): it reopens the engine at a new epoch (fencing the
// dead instance) and RECONFIGUREs the kernel device with new sockets, so
// mounted filesystems see a pause, not an error. The reopen is an attach
// from this node without takeover: if the volume was published to another
// node while the plugin was down, it stays there and the recovery of that
// volume fails (logged; its device fails I/O after the kernel's
// dead-connection timeout), rather than fencing the node that has it now.
// Node calls are served during the recovery; each volume is recovered
// under its operation lock and only while it is still staged and not
// served, and one whose lock a node call holds is left to that call (a
// NodeUnstageVolume serves a staged volume first, so that its unmount's
// writeback has a server). A volume that does not recover is retried in
// the background (1 s, doubling up to 30 s) until it is served, unstaged
// or deleted: the kubelet would not stage it again. A failed look at the
// kernel (a stop during the recovery) keeps the device's record for the
// next start.
//
// # Listings
//
// ListVolumes, ListSnapshots and ControllerListVolumeHealth list in id
// order, at most max_entries entries and 1 MiB a response (a CO's gRPC
// client takes 4 MiB a message by default), with a next_token while
// more remain. A page reads the cluster's listing from where the
// previous page ended, not the whole listing: the token (list.go) holds
// the cluster's page token and the last id listed, and the cluster lists
// in id order (the controller checks it: a listing out of order is
// INTERNAL). So a page costs about one cluster page more than its
// entries (ControllerListVolumeHealth, which lists the abnormal volumes
// only, reads on until it has its page), and entries created or deleted
// between two pages move no other. A starting_token this driver did not
// give for that listing with the same filters (ListSnapshots'
// source_volume_id and snapshot_id), or whose cluster page token the
// cluster refuses, is ABORTED, as the spec asks: the CO lists again from
// the start.
//
// # Health
//
// Three questions, three answers, so that no probe restarts the driver
// for something a restart cannot fix:
//
//   - CSI Probe: the process serves CSI. It is local and cheap: no cluster
//     call, no wait for recovery. The livenessprobe sidecar calls it with a
//     one-second timeout and restarts the container on an error and on
//     ready=false alike, so Probe answers ready=true whenever it answers.
//   - /healthz (Config.HealthListen, stor-csi --health-listen, also named
//     --metrics-listen): the same, over HTTP, for a kubelet livenessProbe
//     without the sidecar. The listener also serves /metrics (package
//     internal/metrics): CSI calls by method and code with their latency,
//     and on a node each staged volume's I/O while it is served.
//   - /readyz (Ready): the controller's cluster answers and has a leader;
//     the node is registered and its staged volumes' recovery has run.
//     deploy/ uses it as the readinessProbe (holds rollouts) and as the
//     node plugin's startupProbe, whose budget (failureThreshold x period)
//     is what recovery gets before the kubelet restarts the plugin.
//
// # Concurrency
//
// Every RPC that names a volume (or a snapshot, or a volume name in
// CreateVolume) takes that key's operation lock without waiting: a
// concurrent operation on the same key is ABORTED, as the spec allows,
// and the CO retries. Every RPC is logged with its method, volume and
// duration; fields the CSI spec marks csi_secret are never logged.
package csi
