package raftstore

import (
	"bytes"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math"
	"math/bits"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

var fsmSeedFlag = flag.Uint64("fsm.seed", 0, "seed for TestFSMDeterministicAcrossBatching's random batch splits; 0 takes one from the clock")

const (
	mib = 1 << 20
	gib = 1 << 30
)

// ------------------------------------------------------------- harness

// tLogWriter routes a slog handler's lines to t.Log.
type tLogWriter struct{ t testing.TB }

func (w tLogWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func newTestLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tLogWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// openTestFSM opens an FSM at path ("" for a new file in t.TempDir()) and
// closes it when the test ends.
func openTestFSM(t testing.TB, path string) *FSM {
	t.Helper()
	if path == "" {
		path = filepath.Join(t.TempDir(), "meta.db")
	}
	f, err := OpenFSM(path, newTestLogger(t))
	if err != nil {
		t.Fatalf("OpenFSM(%s): %v", path, err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// stampAt is the proposer time a test command carries unless it sets one:
// a function of the index, so every FSM that applies an entry sees the same.
func stampAt(index uint64) int64 { return int64(index) * 1_000_000_000 }

// commandLogs turns commands into Raft log entries with indexes first,
// first+1, ...
func commandLogs(t testing.TB, first uint64, cmds ...command) []*raft.Log {
	t.Helper()
	logs := make([]*raft.Log, len(cmds))
	for i, c := range cmds {
		idx := first + uint64(i)
		if c.At == 0 {
			c.At = stampAt(idx)
		}
		data, err := c.encode()
		if err != nil {
			t.Fatalf("encode %v: %v", c.Op, err)
		}
		logs[i] = &raft.Log{Index: idx, Term: 1, Type: raft.LogCommand, Data: data}
	}
	return logs
}

// applyLogs runs one ApplyBatch and returns its answers as results; a
// skipped entry answers the zero result (check raw answers with
// f.ApplyBatch directly where nil matters).
func applyLogs(t testing.TB, f *FSM, logs []*raft.Log) []result {
	t.Helper()
	out := f.ApplyBatch(logs)
	if len(out) != len(logs) {
		t.Fatalf("ApplyBatch of %d entries answered %d", len(logs), len(out))
	}
	res := make([]result, len(out))
	for i, o := range out {
		switch o := o.(type) {
		case nil:
		case result:
			res[i] = o
		default:
			t.Fatalf("entry %d answered %T, want result", logs[i].Index, o)
		}
	}
	return res
}

// applyCommands applies cmds in one ApplyBatch as the entries following the
// FSM's applied index and returns the results.
func applyCommands(t testing.TB, f *FSM, cmds ...command) []result {
	t.Helper()
	return applyLogs(t, f, commandLogs(t, f.AppliedIndex()+1, cmds...))
}

// mustApply applies cmds one ApplyBatch each and fails the test if any is
// refused.
func mustApply(t testing.TB, f *FSM, cmds ...command) []result {
	t.Helper()
	out := make([]result, 0, len(cmds))
	for _, c := range cmds {
		r := applyCommands(t, f, c)[0]
		if r.err != nil {
			t.Fatalf("entry %d (%v %s): %v", f.AppliedIndex(), c.Op, c.ID, r.err)
		}
		out = append(out, r)
	}
	return out
}

func cmdInitCluster(id string) command { return command{Op: opInitCluster, ID: id} }

func cmdRegisterServer(id, zone string, capacity uint64, labels map[string]string) command {
	return command{Op: opRegisterServer, Body: &storpb.Server{
		Id: id, Address: id + ":7000", RaftAddress: id + ":7001", DataAddress: id + ":7002",
		Zone: zone, Labels: labels, CapacityBytes: capacity,
	}}
}

func cmdSetServerState(id string, st storpb.ServerState) command {
	return command{Op: opSetServerState, Body: &storpb.Server{Id: id, State: st}}
}

func cmdRemoveServer(id string) command { return command{Op: opRemoveServer, ID: id} }

func cmdCreateVolume(id, name string, size uint64, replicas uint32) command {
	return cmdCreateVolumeReq(id, &storpb.CreateVolumeRequest{Name: name, SizeBytes: size, ReplicaCount: replicas})
}

func cmdCreateVolumeReq(id string, req *storpb.CreateVolumeRequest) command {
	return command{Op: opCreateVolume, ID: id, Body: req}
}

func cmdDeleteVolume(id string) command {
	return command{Op: opDeleteVolume, Body: &storpb.VolumeRef{Id: id}}
}

func cmdExpandVolume(id string, size uint64) command {
	return command{Op: opExpandVolume, Body: &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, SizeBytes: size}}
}

func cmdAttachVolume(id, node string, takeover bool) command {
	return command{Op: opAttachVolume, Body: &storpb.AttachVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, NodeId: node, Takeover: takeover}}
}

func cmdDetachVolume(id, node string) command {
	return command{Op: opDetachVolume, Body: &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, NodeId: node}}
}

func cmdFenceDetached(id, node string) command {
	return command{Op: opDetachVolume, Body: &storpb.DetachVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, NodeId: node, FenceDetached: true}}
}

func cmdSetReplicaState(volumeID, replicaID string, st storpb.ReplicaState, epoch, generation uint64) command {
	return command{Op: opSetReplicaState, Body: &storpb.SetReplicaStateRequest{
		VolumeId: volumeID, ReplicaId: replicaID, State: st, Epoch: epoch, Generation: generation,
	}}
}

// cmdReplaceReplica removes replicaID (if set) and adds newID (unless
// removeOnly), on serverID if set.
func cmdReplaceReplica(volumeID, replicaID, serverID, newID string, removeOnly bool) command {
	return command{Op: opReplaceReplica, ID: newID, Body: &storpb.ReplaceReplicaRequest{
		Volume: &storpb.VolumeRef{Id: volumeID}, ReplicaId: replicaID, ServerId: serverID, RemoveOnly: removeOnly,
	}}
}

func cmdCreateSnapshot(id, volumeID, name string) command {
	return command{Op: opCreateSnapshot, ID: id, Body: &storpb.CreateSnapshotRequest{VolumeId: volumeID, Name: name}}
}

func cmdDeleteSnapshot(id string) command {
	return command{Op: opDeleteSnapshot, Body: &storpb.SnapshotRef{Id: id}}
}

func cmdRecordCut(snapID string, epoch uint64, cut, missed []string) command {
	return command{Op: opRecordCut, Body: &storpb.RecordSnapshotCutRequest{
		SnapshotId: snapID, Epoch: epoch, CutReplicaIds: cut, MissedReplicaIds: missed, Reason: "test: missed",
	}}
}

func cmdRecordCloneCopied(volumeID, replicaID string) command {
	return command{Op: opRecordCloneCopy, Body: &storpb.RecordCloneCopiedRequest{VolumeId: volumeID, ReplicaId: replicaID}}
}

func cmdRegisterNode(id, zone string, labels map[string]string) command {
	return command{Op: opRegisterNode, Body: &storpb.Node{Id: id, Zone: zone, Labels: labels}}
}

func topo(kv ...string) *storpb.Topology {
	t := &storpb.Topology{Segments: map[string]string{}}
	for i := 0; i+1 < len(kv); i += 2 {
		t.Segments[kv[i]] = kv[i+1]
	}
	return t
}

// richWorkload builds a state that uses every bucket and most fields: 4
// servers in 2 zones with labels and capacity, volumes with parameters,
// accessibility, a content source, an attachment at epoch 2, an expansion,
// replica state changes, snapshots, a deleted volume and snapshot, a volume
// deleted with a snapshot (kept for it) whose name is taken again, a server
// that is down.
func richWorkload() []command {
	return []command{
		cmdInitCluster("cluster-7f3e"),
		cmdRegisterServer("s1", "zone-a", 1*gib, map[string]string{"rack": "r1", "disk": "ssd"}),
		cmdRegisterServer("s2", "zone-a", 1*gib, map[string]string{"rack": "r2"}),
		cmdRegisterServer("s3", "zone-b", 2*gib, map[string]string{"rack": "r3"}),
		cmdRegisterServer("s4", "zone-b", 2*gib, nil),
		cmdCreateVolume("vol-1", "pvc-one", 10*mib, 3),
		cmdCreateVolumeReq("vol-2", &storpb.CreateVolumeRequest{
			Name: "pvc-two", SizeBytes: 5000, ReplicaCount: 2,
			Parameters: map[string]string{"fsType": "xfs", "tier": "gold"},
			Accessibility: &storpb.TopologyRequirement{
				Requisite: []*storpb.Topology{topo("zone", "zone-a")},
				Preferred: []*storpb.Topology{topo("node", "s2")},
			},
		}),
		cmdCreateVolume("vol-3", "pvc-three", 1*mib, 1),
		cmdCreateVolume("vol-4", "pvc-four", 3*mib, 2),
		cmdAttachVolume("vol-1", "node-1", false),
		cmdAttachVolume("vol-1", "node-2", true),
		cmdExpandVolume("vol-4", 6*mib),
		cmdSetReplicaState("vol-4", "vol-4-r2", storpb.ReplicaState_REPLICA_STATE_FAULTY, 0, 0),     // generation 2
		cmdSetReplicaState("vol-4", "vol-4-r2", storpb.ReplicaState_REPLICA_STATE_REBUILDING, 0, 0), // generation 3
		cmdSetReplicaState("vol-1", "vol-1-r3", storpb.ReplicaState_REPLICA_STATE_FAULTY, 2, 0),
		cmdCreateSnapshot("snap-1", "vol-1", "snap-one"),
		cmdCreateSnapshot("snap-2", "vol-2", "snap-two"),
		cmdCreateSnapshot("snap-3", "vol-1", "snap-three"),
		cmdDeleteSnapshot("snap-3"),
		cmdCreateVolumeReq("vol-5", &storpb.CreateVolumeRequest{
			Name: "pvc-five", SizeBytes: 10 * mib, ReplicaCount: 2,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-1"}},
		}),
		cmdRecordCut("snap-1", 2, []string{"vol-1-r1", "vol-1-r2"}, nil),
		cmdCreateVolumeReq("vol-6", &storpb.CreateVolumeRequest{
			Name: "pvc-six", SizeBytes: 6 * mib, ReplicaCount: 1,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-2"}},
		}),
		cmdRecordCut(ImplicitSnapshotID("vol-6"), 0, []string{"vol-2-r1"}, []string{"vol-2-r2"}),
		cmdRecordCloneCopied("vol-6", "vol-6-r1"),
		cmdDeleteVolume("vol-3"),
		// Deleted with a snapshot: kept for it, its name taken again.
		cmdCreateVolume("vol-7", "pvc-seven", mib, 1),
		cmdCreateSnapshot("snap-7", "vol-7", "snap-seven"),
		cmdRecordCut("snap-7", 0, []string{"vol-7-r1"}, nil),
		cmdDeleteVolume("vol-7"),
		cmdCreateVolume("vol-8", "pvc-seven", mib, 1),
		cmdSetServerState("s4", storpb.ServerState_SERVER_STATE_DOWN),
		cmdRegisterNode("worker-1", "zone-a", map[string]string{"pool": "gpu"}),
		cmdRegisterNode("s1", "zone-a", nil), // a server that attaches volumes too
		cmdRegisterNode("worker-1", "zone-b", nil),
	}
}

// checkRichState asserts that richWorkload did what it says, so that tests
// comparing copies of the state compare something.
func checkRichState(t testing.TB, f *FSM) {
	t.Helper()
	err := f.View(func(r *Reader) error {
		if got := r.ClusterID(); got != "cluster-7f3e" {
			t.Errorf("cluster id %q", got)
		}
		v1, err := r.Volume("vol-1")
		if err != nil {
			return err
		}
		if v1.Epoch != 2 || v1.Attachment.GetNodeId() != "node-2" || len(v1.Replicas) != 3 ||
			v1.Generation != 2 || v1.Replicas[2].State != storpb.ReplicaState_REPLICA_STATE_FAULTY {
			t.Errorf("vol-1: %v", v1)
		}
		v2, err := r.VolumeByName("pvc-two")
		if err != nil {
			return err
		}
		if v2.SizeBytes != 8192 || v2.Parameters["tier"] != "gold" || v2.Accessibility == nil ||
			len(v2.Replicas) != 2 || v2.Replicas[0].ServerId != "s2" {
			t.Errorf("vol-2: %v", v2)
		}
		if v4, err := r.Volume("vol-4"); err != nil || v4.SizeBytes != 6*mib || v4.Generation != 3 {
			t.Errorf("vol-4: %v, %v", v4, err)
		}
		if _, err := r.Volume("vol-3"); !errors.Is(err, ErrNotFound) {
			t.Errorf("deleted vol-3: %v", err)
		}
		if v7, err := r.Volume("vol-7"); err != nil || v7.State != storpb.VolumeState_VOLUME_STATE_DELETED {
			t.Errorf("vol-7 (deleted with a snapshot): %v, %v", v7, err)
		}
		if v8, err := r.VolumeByName("pvc-seven"); err != nil || v8.Id != "vol-8" {
			t.Errorf("pvc-seven (the name of deleted vol-7, taken again): %v, %v", v8, err)
		}
		if _, err := r.SnapshotByRef(&storpb.SnapshotRef{Name: "snap-three"}); !errors.Is(err, ErrNotFound) {
			t.Errorf("deleted snap-three: %v", err)
		}
		if s1, err := r.Snapshot("snap-1"); err != nil || !s1.ReadyToUse || s1.CutEpoch != 2 || len(s1.Replicas) != 2 {
			t.Errorf("snap-1: %v, %v", s1, err)
		}
		if s2, err := r.Snapshot("snap-2"); err != nil || s2.ReadyToUse || s2.StatusMessage == "" {
			t.Errorf("snap-2 (never cut): %v, %v", s2, err)
		}
		if v5, err := r.Volume("vol-5"); err != nil || v5.State != storpb.VolumeState_VOLUME_STATE_CREATING || v5.CloneSnapshotId != "snap-1" {
			t.Errorf("vol-5 (clone still copying): %v, %v", v5, err)
		}
		if v6, err := r.Volume("vol-6"); err != nil || v6.State != storpb.VolumeState_VOLUME_STATE_AVAILABLE {
			t.Errorf("vol-6 (clone copied): %v, %v", v6, err)
		}
		if _, err := r.Snapshot(ImplicitSnapshotID("vol-6")); !errors.Is(err, ErrNotFound) {
			t.Errorf("vol-6's implicit snapshot after its copy: %v", err)
		}
		if s4, err := r.Server("s4"); err != nil || s4.State != storpb.ServerState_SERVER_STATE_DOWN {
			t.Errorf("s4: %v, %v", s4, err)
		}
		if w1, err := r.Node("worker-1"); err != nil || w1.Zone != "zone-b" || len(w1.Labels) != 0 ||
			w1.RegisteredUnixNano == 0 || w1.LastRegisteredUnixNano <= w1.RegisteredUnixNano {
			t.Errorf("worker-1 (registered twice): %v, %v", w1, err)
		}
		if nodes, err := r.Nodes(); err != nil || len(nodes) != 2 || nodes[0].Id != "s1" || nodes[1].Id != "worker-1" {
			t.Errorf("nodes: %v, %v", nodes, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// ---------------------------------------------------------- state dumps

// stateDump is every bucket of an FSM's bbolt file: bucket -> key -> value.
type stateDump map[string]map[string]string

// dumpState walks every bucket (not only the known ones) in one read
// transaction.
func dumpState(t testing.TB, f *FSM) stateDump {
	t.Helper()
	d := stateDump{}
	f.mu.RLock()
	defer f.mu.RUnlock()
	err := f.db.View(func(tx *bolt.Tx) error {
		return tx.ForEach(func(name []byte, b *bolt.Bucket) error {
			m := map[string]string{}
			d[string(name)] = m
			return b.ForEach(func(k, v []byte) error {
				if v == nil {
					v = []byte("<nested bucket>")
				}
				m[string(k)] = string(v)
				return nil
			})
		})
	})
	if err != nil {
		t.Fatalf("dump %s: %v", f.path, err)
	}
	return d
}

// withoutApplied is d without meta/applied_index.
func withoutApplied(d stateDump) stateDump {
	out := stateDump{}
	for b, m := range d {
		out[b] = maps.Clone(m)
	}
	delete(out[string(bucketMeta)], string(keyAppliedIndex))
	return out
}

// diffStates lists the differences between two dumps, values rendered
// readably, in a stable order.
func diffStates(want, got stateDump) []string {
	var diffs []string
	for _, b := range slices.Sorted(maps.Keys(mergeKeys(want, got))) {
		w, g := want[b], got[b]
		if w == nil || g == nil {
			diffs = append(diffs, fmt.Sprintf("bucket %s: present in want %v, in got %v", b, w != nil, g != nil))
			continue
		}
		for _, k := range slices.Sorted(maps.Keys(mergeKeys(w, g))) {
			wv, wok := w[k]
			gv, gok := g[k]
			if wok == gok && wv == gv {
				continue
			}
			diffs = append(diffs, fmt.Sprintf("%s/%s:\n\twant %s\n\tgot  %s", b, k, renderValue(b, k, wv, wok), renderValue(b, k, gv, gok)))
		}
	}
	return diffs
}

func mergeKeys[V any](a, b map[string]V) map[string]bool {
	out := map[string]bool{}
	for k := range a {
		out[k] = true
	}
	for k := range b {
		out[k] = true
	}
	return out
}

func renderValue(bucket, key, v string, ok bool) string {
	if !ok {
		return "<absent>"
	}
	var m proto.Message
	switch bucket {
	case string(bucketServers):
		m = &storpb.Server{}
	case string(bucketVolumes):
		m = &storpb.Volume{}
	case string(bucketSnapshots):
		m = &storpb.Snapshot{}
	case string(bucketNodes):
		m = &storpb.Node{}
	case string(bucketMeta):
		if key == string(keyAppliedIndex) && len(v) == 8 {
			return fmt.Sprint(binary.BigEndian.Uint64([]byte(v)))
		}
	}
	if m != nil && proto.Unmarshal([]byte(v), m) == nil {
		return "{" + prototext.MarshalOptions{}.Format(m) + "}"
	}
	return fmt.Sprintf("%q", v)
}

func requireSameState(t testing.TB, want, got stateDump, what string) {
	t.Helper()
	if diffs := diffStates(want, got); len(diffs) > 0 {
		t.Fatalf("%s: %d differences:\n%s", what, len(diffs), strings.Join(diffs, "\n"))
	}
}

func readVolume(t testing.TB, f *FSM, id string) *storpb.Volume {
	t.Helper()
	var v *storpb.Volume
	if err := f.View(func(r *Reader) error {
		var err error
		v, err = r.Volume(id)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return v
}

// resultsEqual compares two answers: same error text, equal messages.
func resultsEqual(a, b result) bool {
	if (a.err == nil) != (b.err == nil) || (a.err != nil && a.err.Error() != b.err.Error()) {
		return false
	}
	if a.msg == nil || b.msg == nil {
		return a.msg == nil && b.msg == nil
	}
	return proto.Equal(a.msg, b.msg)
}

// ------------------------------------------------------------ snapshots

// memSink is a raft.SnapshotSink in memory.
type memSink struct {
	bytes.Buffer
	closed, cancelled bool
}

func (s *memSink) ID() string    { return "mem" }
func (s *memSink) Cancel() error { s.cancelled = true; return nil }
func (s *memSink) Close() error  { s.closed = true; return nil }

var _ raft.SnapshotSink = (*memSink)(nil)

func persist(t testing.TB, snap raft.FSMSnapshot) []byte {
	t.Helper()
	sink := &memSink{}
	if err := snap.Persist(sink); err != nil {
		t.Fatalf("Persist: %v", err)
	}
	snap.Release()
	if !sink.closed || sink.cancelled {
		t.Fatalf("Persist left the sink closed=%v cancelled=%v, want closed", sink.closed, sink.cancelled)
	}
	return sink.Bytes()
}

func snapshotBytes(t testing.TB, f *FSM) []byte {
	t.Helper()
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	return persist(t, snap)
}

func clusterID(t testing.TB, f *FSM) string {
	t.Helper()
	var id string
	if err := f.View(func(r *Reader) error { id = r.ClusterID(); return nil }); err != nil {
		t.Fatal(err)
	}
	return id
}

func TestFSMSnapshotRestoreRoundTrip(t *testing.T) {
	src := openTestFSM(t, "")
	mustApply(t, src, richWorkload()...)
	checkRichState(t, src)
	want := dumpState(t, src)
	wantIndex := src.AppliedIndex()

	snap, err := src.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	// The snapshot is the state when Snapshot returned: Raft persists it
	// while it goes on applying.
	next := []command{
		cmdCreateVolume("vol-6", "pvc-six", 2*mib, 2),
		cmdAttachVolume("vol-4", "node-3", false),
	}
	srcNext := applyCommands(t, src, next...)
	image := persist(t, snap)

	t.Run("fresh", func(t *testing.T) {
		dst := openTestFSM(t, "")
		if err := dst.Restore(io.NopCloser(bytes.NewReader(image))); err != nil {
			t.Fatalf("Restore: %v", err)
		}
		requireSameState(t, want, dumpState(t, dst), "restored state")
		checkRichState(t, dst)
		if got := dst.AppliedIndex(); got != wantIndex {
			t.Errorf("restored AppliedIndex() = %d, want %d", got, wantIndex)
		}
		if got, want := clusterID(t, dst), "cluster-7f3e"; got != want {
			t.Errorf("restored ClusterID() = %q, want %q", got, want)
		}
		if _, err := os.Stat(dst.path + ".restore"); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("restore left its temporary file behind: %v", err)
		}

		// The restored FSM goes on exactly like the source.
		dstNext := applyCommands(t, dst, next...)
		for i := range next {
			if !resultsEqual(srcNext[i], dstNext[i]) {
				t.Errorf("entry %d: source answered %v, restored FSM %v", i, srcNext[i], dstNext[i])
			}
		}
		requireSameState(t, dumpState(t, src), dumpState(t, dst), "after one more batch")
		more := []command{cmdRemoveServer("s1"), cmdDeleteVolume("vol-2"), cmdDetachVolume("vol-1", "")}
		applyCommands(t, src, more...)
		applyCommands(t, dst, more...)
		requireSameState(t, dumpState(t, src), dumpState(t, dst), "after removing a server")
		if src.AppliedIndex() != dst.AppliedIndex() {
			t.Errorf("AppliedIndex: source %d, restored %d", src.AppliedIndex(), dst.AppliedIndex())
		}
	})

	t.Run("over other state", func(t *testing.T) {
		// Restore replaces everything, including keys the snapshot does
		// not have and an applied index beyond the snapshot's.
		dst := openTestFSM(t, "")
		mustApply(t, dst,
			cmdInitCluster("other-cluster"),
			cmdRegisterServer("zz", "zone-z", 0, map[string]string{"x": "y"}),
			cmdCreateVolume("vol-stale", "pvc-stale", mib, 1),
			cmdCreateSnapshot("snap-stale", "vol-stale", "snap-stale"),
		)
		logs := commandLogs(t, wantIndex+10, cmdCreateVolume("vol-later", "pvc-later", mib, 1))
		applyLogs(t, dst, logs)
		if err := dst.Restore(io.NopCloser(bytes.NewReader(image))); err != nil {
			t.Fatalf("Restore: %v", err)
		}
		requireSameState(t, want, dumpState(t, dst), "restored over other state")
		if got := dst.AppliedIndex(); got != wantIndex {
			t.Errorf("AppliedIndex() = %d, want %d", got, wantIndex)
		}
	})
}

// TestFSMRestoreRejectsBadImage: an image that is not a state machine
// database is refused, and the state stays as it was.
func TestFSMRestoreRejectsBadImage(t *testing.T) {
	good := openTestFSM(t, "")
	mustApply(t, good, richWorkload()...)
	image := snapshotBytes(t, good)

	for _, tc := range []struct {
		name  string
		image []byte
	}{
		{"empty", nil},
		{"garbage", bytes.Repeat([]byte("not a bbolt file "), 1000)},
		{"first page only", image[:os.Getpagesize()]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := openTestFSM(t, "")
			mustApply(t, f, cmdRegisterServer("s1", "", 0, nil), cmdCreateVolume("vol-1", "pvc-1", mib, 1))
			before := dumpState(t, f)
			if err := f.Restore(io.NopCloser(bytes.NewReader(tc.image))); err == nil {
				t.Errorf("Restore accepted a %d-byte %s image; AppliedIndex() is now %d", len(tc.image), tc.name, f.AppliedIndex())
				if diffs := diffStates(before, dumpState(t, f)); len(diffs) > 0 {
					t.Fatalf("and replaced the state (%d differences):\n%s", len(diffs), strings.Join(diffs, "\n"))
				}
			}
			requireSameState(t, before, dumpState(t, f), "state after a refused restore")
			if _, err := os.Stat(f.path + ".restore"); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("refused restore left its temporary file behind: %v", err)
			}
			mustApply(t, f, cmdAttachVolume("vol-1", "n1", false))
		})
	}
}

// restoreChildEnv names the truncation TestFSMRestoreTruncatedImage's child
// process applies.
const restoreChildEnv = "STOR_RAFTSTORE_RESTORE_TRUNCATED_PAGES"

// TestFSMRestoreTruncatedImage: Restore of a truncated image either refuses
// it or restores what the image holds; it must not take the process down.
// Each case runs in a child process, so that a crash is this test's
// failure and not the end of the whole test binary.
func TestFSMRestoreTruncatedImage(t *testing.T) {
	if pages := os.Getenv(restoreChildEnv); pages != "" {
		n, err := strconv.Atoi(pages)
		if err != nil {
			t.Fatal(err)
		}
		restoreTruncated(t, n)
		return
	}
	for _, pages := range []int{2, 3, 4, 5} {
		t.Run(fmt.Sprintf("%d pages", pages), func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestFSMRestoreTruncatedImage$", "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", restoreChildEnv, pages))
			out, err := cmd.CombinedOutput()
			if err != nil {
				lines := strings.Split(strings.TrimSpace(string(out)), "\n")
				t.Fatalf("restoring an image cut to %d pages: child %v; its output begins:\n%s",
					pages, err, strings.Join(lines[:min(len(lines), 12)], "\n"))
			}
		})
	}
}

func restoreTruncated(t *testing.T, pages int) {
	src := openTestFSM(t, "")
	mustApply(t, src, richWorkload()...)
	image := snapshotBytes(t, src)
	cut := pages * os.Getpagesize()
	if cut >= len(image) {
		t.Skipf("image has only %d bytes", len(image))
	}
	f := openTestFSM(t, "")
	mustApply(t, f, cmdRegisterServer("s1", "", 0, nil))
	before := dumpState(t, f)
	if err := f.Restore(io.NopCloser(bytes.NewReader(image[:cut]))); err != nil {
		t.Logf("refused: %v", err)
		requireSameState(t, before, dumpState(t, f), "state after a refused restore")
		return
	}
	requireSameState(t, dumpState(t, src), dumpState(t, f), "state restored from a truncated image")
}

// ------------------------------------------------------------ replaying

// replayWorkload has attaches, whose epoch bumps show a double apply.
func replayWorkload() []command {
	return []command{
		cmdInitCluster("c1"),
		cmdRegisterServer("s1", "a", 0, nil),
		cmdRegisterServer("s2", "b", 0, nil),
		cmdRegisterServer("s3", "c", 0, nil),
		cmdCreateVolume("vol-1", "pvc-1", mib, 3),
		cmdAttachVolume("vol-1", "node-1", false),      // epoch 1
		cmdAttachVolume("vol-1", "node-2", true),       // epoch 2
		cmdCreateSnapshot("snap-1", "vol-1", "snap-1"), //
		cmdDetachVolume("vol-1", ""),                   // epoch 3
		cmdRecordCut("snap-1", 3, []string{"vol-1-r1", "vol-1-r2", "vol-1-r3"}, nil),
		cmdAttachVolume("vol-1", "node-1", false), // epoch 4
		cmdExpandVolume("vol-1", 2*mib),           // (once snap-1 is cut)
		cmdCreateVolume("vol-2", "pvc-2", mib, 2), //
		cmdAttachVolume("vol-2", "node-2", false), // vol-2 epoch 1
		cmdRegisterNode("node-1", "a", nil),       //
		cmdRegisterNode("node-1", "b", nil),       // re-registered: zone b
	}
}

func TestFSMReplayIsIdempotent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "meta.db")
	f := openTestFSM(t, path)
	logs := commandLogs(t, 1, replayWorkload()...)
	n := uint64(len(logs))
	// Applied in Raft-sized batches.
	for _, batch := range [][]*raft.Log{logs[:4], logs[4:7], logs[7:]} {
		for i, r := range applyLogs(t, f, batch) {
			if r.err != nil {
				t.Fatalf("entry %d: %v", batch[i].Index, r.err)
			}
		}
	}
	if got := readVolume(t, f, "vol-1").Epoch; got != 4 {
		t.Fatalf("vol-1 epoch %d after the workload, want 4", got)
	}
	want := dumpState(t, f)

	assertSkipped := func(t *testing.T, f *FSM, logs []*raft.Log) {
		t.Helper()
		out := f.ApplyBatch(logs)
		for i, o := range out {
			if o != nil {
				t.Errorf("replayed entry %d answered %#v, want nil", logs[i].Index, o)
			}
		}
	}

	// Raft replays everything after its snapshot; here, all of it, once
	// in one batch and once entry by entry.
	assertSkipped(t, f, logs)
	for _, l := range logs {
		assertSkipped(t, f, []*raft.Log{l})
	}
	requireSameState(t, want, dumpState(t, f), "after replay")
	if got := f.AppliedIndex(); got != n {
		t.Fatalf("AppliedIndex() = %d after replay, want %d", got, n)
	}

	// A batch that straddles the applied index applies only the new part.
	fresh := commandLogs(t, n+1, cmdAttachVolume("vol-1", "node-3", true))
	mixed := append(slices.Clone(logs[n-2:]), fresh...)
	out := f.ApplyBatch(mixed)
	if out[0] != nil || out[1] != nil {
		t.Errorf("replayed entries answered %#v, %#v, want nil", out[0], out[1])
	}
	r, ok := out[2].(result)
	if !ok || r.err != nil {
		t.Fatalf("new entry answered %#v", out[2])
	}
	if got := r.msg.(*storpb.Volume).Epoch; got != 5 {
		t.Fatalf("new attach answered epoch %d, want 5", got)
	}
	want = dumpState(t, f)
	all := append(slices.Clone(logs), fresh...)

	// Restart: the applied index comes back from the file.
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	f = openTestFSM(t, path)
	if got := f.AppliedIndex(); got != n+1 {
		t.Fatalf("reopened AppliedIndex() = %d, want %d", got, n+1)
	}
	requireSameState(t, want, dumpState(t, f), "reopened state")
	assertSkipped(t, f, all)
	requireSameState(t, want, dumpState(t, f), "reopened state after replay")
	if got := readVolume(t, f, "vol-1").Epoch; got != 5 {
		t.Fatalf("vol-1 epoch %d after replay, want 5", got)
	}
	// And the next entry applies.
	res := applyLogs(t, f, commandLogs(t, n+2, cmdAttachVolume("vol-1", "node-1", true)))
	if res[0].err != nil || res[0].msg.(*storpb.Volume).Epoch != 6 {
		t.Fatalf("entry %d after restart: %v", n+2, res[0])
	}
	if got := f.AppliedIndex(); got != n+2 {
		t.Fatalf("AppliedIndex() = %d, want %d", got, n+2)
	}
}

// TestFSMNonCommandEntriesAdvanceIndex: configuration and no-op entries
// change no state but are applied, so they are not replayed either.
func TestFSMNonCommandEntriesAdvanceIndex(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdRegisterServer("s1", "", 0, nil))
	before := dumpState(t, f)
	out := f.ApplyBatch([]*raft.Log{
		{Index: 2, Type: raft.LogConfiguration, Data: []byte("whatever raft encodes")},
		{Index: 3, Type: raft.LogNoop},
	})
	if out[0] != nil || out[1] != nil {
		t.Errorf("non-command entries answered %#v", out)
	}
	if got := f.AppliedIndex(); got != 3 {
		t.Errorf("AppliedIndex() = %d, want 3", got)
	}
	requireSameState(t, withoutApplied(before), withoutApplied(dumpState(t, f)), "after non-command entries")
}

// ---------------------------------------------------------- determinism

// determinismWorkload mixes the rich state with refused commands, no-ops,
// a removed server and a re-registered one.
func determinismWorkload() []command {
	cmds := richWorkload()
	return append(cmds,
		cmdCreateVolume("vol-x", "pvc-one", 1, 1),            // refused: name taken
		cmdCreateVolume("vol-1-again", "pvc-one", 10*mib, 3), // idempotent
		cmdExpandVolume("vol-1", 4096),                       // refused: shrink
		cmdExpandVolume("vol-1", 10*mib),                     // no-op
		cmdDeleteVolume("vol-1"),                             // refused: attached
		cmdSetReplicaState("vol-4", "vol-4-r2", storpb.ReplicaState_REPLICA_STATE_HEALTHY, 0, 2), // refused: rebuild from generation 2
		cmdSetReplicaState("vol-4", "vol-4-r2", storpb.ReplicaState_REPLICA_STATE_HEALTHY, 0, 3),
		cmdReplaceReplica("vol-1", "vol-1-r3", "", "vol-1-r4", false),
		cmdSetReplicaState("vol-1", "vol-1-r1", storpb.ReplicaState_REPLICA_STATE_FAULTY, 1, 0), // refused: stale epoch
		cmdRemoveServer("s2"),
		cmdCreateVolume("vol-7", "pvc-seven", 7*mib, 2),
		cmdRegisterServer("s5", "zone-c", 4*gib, map[string]string{"rack": "r5"}),
		cmdSetServerState("s4", storpb.ServerState_SERVER_STATE_UP),
		cmdCreateVolume("vol-8", "pvc-eight", 8*mib, 4),
		cmdDetachVolume("vol-1", "node-9"), // no-op: attached elsewhere
		cmdDetachVolume("vol-1", "node-2"),
		cmdDeleteSnapshot("snap-1"),
		cmdDeleteVolume("vol-5"),
		cmdInitCluster("too-late"),               // no-op: first one wins
		cmdRegisterNode("bad id", "zone-a", nil), // refused: whitespace
		cmdRegisterNode("worker-2", "zone-c", map[string]string{"a": "1", "b": "2", "c": "3"}),
		cmdRegisterNode("worker-1", "zone-a", map[string]string{"pool": "cpu"}),
	)
}

func TestFSMDeterministicAcrossBatching(t *testing.T) {
	cmds := determinismWorkload()
	logs := commandLogs(t, 1, cmds...)

	one := openTestFSM(t, "")
	var want []result
	for _, l := range logs {
		want = append(want, applyLogs(t, one, []*raft.Log{l})...)
	}
	wantState := dumpState(t, one)

	seed := *fsmSeedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d; reproduce with -fsm.seed=%d", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	variants := map[string][][]*raft.Log{"one batch": {logs}}
	for v := range 3 {
		var batches [][]*raft.Log
		for rest := logs; len(rest) > 0; {
			n := 1 + rng.IntN(min(len(rest), 8))
			batches = append(batches, rest[:n])
			rest = rest[n:]
		}
		variants[fmt.Sprintf("random batches %d", v)] = batches
	}
	for name, batches := range variants {
		t.Run(name, func(t *testing.T) {
			f := openTestFSM(t, "")
			var got []result
			for _, b := range batches {
				got = append(got, applyLogs(t, f, b)...)
			}
			for i := range want {
				if !resultsEqual(want[i], got[i]) {
					t.Errorf("entry %d (%v): one by one answered %v, batched %v", i+1, cmds[i].Op, want[i], got[i])
				}
			}
			requireSameState(t, wantState, dumpState(t, f), "batched state")
		})
	}
}

// ------------------------------------------------------------- refusals

// refusalBase: 4 up servers with 1 GiB each in 2 zones; vol-a attached to
// node-1 (epoch 1) with a faulty replica; vol-b with a snapshot and one
// replica healthy, the other rebuilding.
func refusalBase(t testing.TB) *FSM {
	f := openTestFSM(t, "")
	mustApply(t, f,
		cmdInitCluster("c1"),
		cmdRegisterServer("s1", "a", gib, nil),
		cmdRegisterServer("s2", "a", gib, nil),
		cmdRegisterServer("s3", "b", gib, nil),
		cmdRegisterServer("s4", "b", gib, nil),
		cmdCreateVolumeReq("vol-a", &storpb.CreateVolumeRequest{
			Name: "pvc-a", SizeBytes: mib, ReplicaCount: 3, Parameters: map[string]string{"k": "v"},
		}),
		cmdAttachVolume("vol-a", "node-1", false),
		cmdCreateVolume("vol-b", "pvc-b", mib, 2),
		cmdCreateSnapshot("snap-b", "vol-b", "snap-b"),
		cmdSetReplicaState("vol-a", "vol-a-r3", storpb.ReplicaState_REPLICA_STATE_FAULTY, 1, 0),
		cmdSetReplicaState("vol-b", "vol-b-r1", storpb.ReplicaState_REPLICA_STATE_FAULTY, 0, 0),     // generation 2
		cmdSetReplicaState("vol-b", "vol-b-r1", storpb.ReplicaState_REPLICA_STATE_REBUILDING, 0, 0), // generation 3
	)
	return f
}

func TestFSMRefusedCommandsLeaveNoTrace(t *testing.T) {
	f := refusalBase(t)
	cases := []struct {
		name string
		cmd  command
		want error
	}{
		{"create: more replicas than servers", cmdCreateVolume("v", "new", mib, 5), ErrInsufficientServers},
		{"create: more replicas than allowed", cmdCreateVolume("v", "new", mib, MaxReplicas+1), ErrInvalidArgument},
		{"create: zero replicas", cmdCreateVolume("v", "new", mib, 0), ErrInvalidArgument},
		{"create: size zero", cmdCreateVolume("v", "new", 0, 1), ErrInvalidArgument},
		{"create: empty name", cmdCreateVolume("v", "", mib, 1), ErrInvalidArgument},
		{"create: name with space", cmdCreateVolume("v", "a b", mib, 1), ErrInvalidArgument},
		{"create: name too long", cmdCreateVolume("v", strings.Repeat("n", maxNameLen+1), mib, 1), ErrInvalidArgument},
		{"create: name taken with another size", cmdCreateVolume("v", "pvc-a", 2*mib, 3), ErrAlreadyExists},
		{"create: name taken with other parameters", cmdCreateVolume("v", "pvc-a", mib, 3), ErrAlreadyExists},
		{"create: no server in the requisite zone", cmdCreateVolumeReq("v", &storpb.CreateVolumeRequest{
			Name: "new", SizeBytes: mib, ReplicaCount: 1,
			Accessibility: &storpb.TopologyRequirement{Requisite: []*storpb.Topology{topo("zone", "c")}},
		}), ErrInsufficientServers},
		{"create: larger than any server", cmdCreateVolume("v", "new", 2*gib, 1), ErrInsufficientCapacity},
		{"create: unknown source snapshot", cmdCreateVolumeReq("v", &storpb.CreateVolumeRequest{
			Name: "new", SizeBytes: mib, ReplicaCount: 1,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "nope"}},
		}), ErrNotFound},
		{"create: smaller than its source volume", cmdCreateVolumeReq("v", &storpb.CreateVolumeRequest{
			Name: "new", SizeBytes: 4096, ReplicaCount: 1,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-a"}},
		}), ErrInvalidArgument},
		{"delete: attached", cmdDeleteVolume("vol-a"), ErrFailedPrecondition},
		{"delete: unknown", cmdDeleteVolume("nope"), ErrNotFound},
		{"delete: id and name", command{Op: opDeleteVolume, Body: &storpb.VolumeRef{Id: "vol-b", Name: "pvc-b"}}, ErrInvalidArgument},
		{"delete: empty ref", command{Op: opDeleteVolume, Body: &storpb.VolumeRef{}}, ErrInvalidArgument},
		{"expand: shrink", cmdExpandVolume("vol-a", 4096), ErrFailedPrecondition},
		{"expand: size zero", cmdExpandVolume("vol-a", 0), ErrInvalidArgument},
		{"expand: beyond capacity", cmdExpandVolume("vol-a", 2*gib), ErrInsufficientCapacity},
		{"expand: unknown", cmdExpandVolume("nope", gib), ErrNotFound},
		{"expand: a snapshot not yet cut", cmdExpandVolume("vol-b", 2*mib), ErrFailedPrecondition},
		{"attach: elsewhere without takeover", cmdAttachVolume("vol-a", "node-2", false), ErrFailedPrecondition},
		{"attach: empty node", cmdAttachVolume("vol-b", "", false), ErrInvalidArgument},
		{"attach: unknown", cmdAttachVolume("nope", "node-1", false), ErrNotFound},
		{"detach: unknown", cmdDetachVolume("nope", ""), ErrNotFound},
		{"fence detached: attached", cmdFenceDetached("vol-a", ""), ErrFailedPrecondition},
		{"fence detached: a node named", cmdFenceDetached("vol-b", "node-1"), ErrInvalidArgument},
		{"snapshot: unknown volume", cmdCreateSnapshot("sn", "nope", "new"), ErrNotFound},
		{"snapshot: name taken for another volume", cmdCreateSnapshot("sn", "vol-a", "snap-b"), ErrAlreadyExists},
		{"snapshot: empty name", cmdCreateSnapshot("sn", "vol-a", ""), ErrInvalidArgument},
		{"snapshot: empty volume id", cmdCreateSnapshot("sn", "", "new"), ErrInvalidArgument},
		{"delete snapshot: unknown", cmdDeleteSnapshot("nope"), ErrNotFound},
		{"server state: unknown server", cmdSetServerState("nope", storpb.ServerState_SERVER_STATE_DOWN), ErrNotFound},
		{"server state: unspecified", cmdSetServerState("s1", storpb.ServerState_SERVER_STATE_UNSPECIFIED), ErrInvalidArgument},
		{"register: no raft address", command{Op: opRegisterServer, Body: &storpb.Server{Id: "s9", Address: "s9:7000"}}, ErrInvalidArgument},
		{"remove server: unknown", cmdRemoveServer("nope"), ErrNotFound},
		{"register node: empty id", cmdRegisterNode("", "a", nil), ErrInvalidArgument},
		{"register node: id with a slash", cmdRegisterNode("a/b", "a", nil), ErrInvalidArgument},
		{"register node: id starting with '-'", cmdRegisterNode("-n", "a", nil), ErrInvalidArgument},
		{"register node: id of 254 bytes", cmdRegisterNode(strings.Repeat("n", 254), "a", nil), ErrInvalidArgument},
		{"register node: no body", command{Op: opRegisterNode}, ErrInvalidArgument},
		{"replica state: stale epoch", cmdSetReplicaState("vol-a", "vol-a-r1", storpb.ReplicaState_REPLICA_STATE_FAULTY, 0, 0), ErrStaleEpoch},
		{"replica state: future epoch", cmdSetReplicaState("vol-a", "vol-a-r1", storpb.ReplicaState_REPLICA_STATE_FAULTY, 2, 0), ErrStaleEpoch},
		{"replica state: unknown volume", cmdSetReplicaState("nope", "nope-r1", storpb.ReplicaState_REPLICA_STATE_FAULTY, 0, 0), ErrNotFound},
		{"replica state: unknown replica", cmdSetReplicaState("vol-a", "vol-b-r1", storpb.ReplicaState_REPLICA_STATE_FAULTY, 1, 0), ErrNotFound},
		{"replica state: fault the last healthy replica", cmdSetReplicaState("vol-b", "vol-b-r2", storpb.ReplicaState_REPLICA_STATE_FAULTY, 0, 0), ErrFailedPrecondition},
		{"replica state: healthy without a rebuild", cmdSetReplicaState("vol-a", "vol-a-r3", storpb.ReplicaState_REPLICA_STATE_HEALTHY, 1, 2), ErrFailedPrecondition},
		{"replica state: healthy from an older rebuild", cmdSetReplicaState("vol-b", "vol-b-r1", storpb.ReplicaState_REPLICA_STATE_HEALTHY, 0, 2), ErrFailedPrecondition},
		{"replica state: unspecified", cmdSetReplicaState("vol-a", "vol-a-r1", storpb.ReplicaState_REPLICA_STATE_UNSPECIFIED, 1, 0), ErrInvalidArgument},
		{"replica state: rebuild a healthy replica", cmdSetReplicaState("vol-a", "vol-a-r1", storpb.ReplicaState_REPLICA_STATE_REBUILDING, 1, 0), ErrFailedPrecondition},
		{"replace replica: unknown volume", cmdReplaceReplica("nope", "nope-r1", "", "new-r", false), ErrNotFound},
		{"replace replica: unknown replica", cmdReplaceReplica("vol-a", "nope", "", "new-r", false), ErrNotFound},
		{"replace replica: remove only, no replica", cmdReplaceReplica("vol-a", "", "", "", true), ErrInvalidArgument},
		{"replace replica: add to a full volume", cmdReplaceReplica("vol-a", "", "", "new-r", false), ErrFailedPrecondition},
		{"replace replica: remove the last healthy", cmdReplaceReplica("vol-b", "vol-b-r2", "", "", true), ErrFailedPrecondition},
		{"replace replica: unknown server", cmdReplaceReplica("vol-a", "vol-a-r3", "nope", "new-r", false), ErrNotFound},
		{"replace replica: server already holds one", cmdReplaceReplica("vol-a", "vol-a-r3", "s1", "new-r", false), ErrInsufficientServers},
		{"replace replica: no new replica id", cmdReplaceReplica("vol-a", "vol-a-r3", "", "", false), ErrCorrupt},
	}
	if v := readVolume(t, f, "vol-a"); v.Replicas[0].ServerId != "s1" {
		t.Fatalf("fixture: vol-a-r1 is on %s; the case \"server already holds one\" assumes s1", v.Replicas[0].ServerId)
	}
	// Sentinels are distinct: a case that only matched a broader one
	// would not show which error the FSM chose.
	all := []error{ErrNotFound, ErrAlreadyExists, ErrInvalidArgument, ErrFailedPrecondition,
		ErrInsufficientServers, ErrInsufficientCapacity, ErrStaleEpoch, ErrCorrupt}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := dumpState(t, f)
			idx := f.AppliedIndex()
			r := applyCommands(t, f, tc.cmd)[0]
			if !errors.Is(r.err, tc.want) {
				t.Fatalf("answered %v, %v; want %v", r.msg, r.err, tc.want)
			}
			for _, other := range all {
				if other != tc.want && errors.Is(r.err, other) {
					t.Errorf("error %q also matches %v", r.err, other)
				}
			}
			if r.msg != nil {
				t.Errorf("refused command answered a message too: %v", r.msg)
			}
			if got := f.AppliedIndex(); got != idx+1 {
				t.Errorf("AppliedIndex() = %d, want %d", got, idx+1)
			}
			requireSameState(t, withoutApplied(before), withoutApplied(dumpState(t, f)), "state after a refused command")
		})
	}
}

// TestFSMRefusedCommandInBatch: a refused command in the middle of a batch
// (one bbolt transaction) leaves nothing behind either; the state equals
// that of an FSM that got a no-op entry in its place.
func TestFSMRefusedCommandInBatch(t *testing.T) {
	a, b := refusalBase(t), refusalBase(t)
	first := cmdCreateVolume("vol-c", "pvc-c", mib, 2)
	last := cmdExpandVolume("vol-c", 2*mib)
	refused := []command{
		cmdCreateVolume("vol-d", "pvc-d", mib, 5),
		cmdExpandVolume("vol-a", 2*gib),
		cmdExpandVolume("vol-b", 2*mib), // snap-b not yet cut
		cmdDeleteVolume("vol-a"),
		cmdAttachVolume("vol-a", "node-2", false),
	}
	idx := a.AppliedIndex()
	cmds := append(append([]command{first}, refused...), last)
	res := applyLogs(t, a, commandLogs(t, idx+1, cmds...))
	for i, r := range res {
		if refusedEntry := i > 0 && i < len(res)-1; (r.err != nil) != refusedEntry {
			t.Errorf("entry %d (%v): %v", i, cmds[i].Op, r.err)
		}
	}
	logs := commandLogs(t, idx+1, first)
	for i := range refused {
		logs = append(logs, &raft.Log{Index: idx + 2 + uint64(i), Type: raft.LogNoop})
	}
	logs = append(logs, commandLogs(t, idx+2+uint64(len(refused)), last)...)
	applyLogs(t, b, logs)
	requireSameState(t, dumpState(t, b), dumpState(t, a), "batch with refused commands")
}

// TestFSMCorruptEntry: an undecodable entry is answered with ErrCorrupt and
// does not keep the rest of its batch from applying.
func TestFSMCorruptEntry(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdRegisterServer("s1", "", 0, nil))
	good1, err := cmdCreateVolume("vol-1", "pvc-1", mib, 1).encode()
	if err != nil {
		t.Fatal(err)
	}
	good2, err := cmdCreateVolume("vol-2", "pvc-2", mib, 1).encode()
	if err != nil {
		t.Fatal(err)
	}
	unknownOp, err := command{Op: op(99), ID: "x"}.encode()
	if err != nil {
		t.Fatal(err)
	}
	badBody := append(slices.Clone(good1[:11+len("vol-1")]), 0xff, 0xff, 0xff)
	entries := []struct {
		name    string
		data    []byte
		corrupt bool
	}{
		{"good", good1, false},
		{"garbage", []byte("this is not a command"), true},
		{"empty", nil, true},
		{"unknown op", unknownOp, true},
		{"truncated", good2[:5], true},
		{"bad body", badBody, true},
		{"good after corrupt ones", good2, false},
	}
	var logs []*raft.Log
	for i, e := range entries {
		logs = append(logs, &raft.Log{Index: uint64(2 + i), Type: raft.LogCommand, Data: e.data})
	}
	res := applyLogs(t, f, logs)
	for i, e := range entries {
		switch {
		case e.corrupt && !errors.Is(res[i].err, ErrCorrupt):
			t.Errorf("%s entry answered %v, %v; want ErrCorrupt", e.name, res[i].msg, res[i].err)
		case e.corrupt && res[i].msg != nil:
			t.Errorf("%s entry answered a message %v", e.name, res[i].msg)
		case !e.corrupt && res[i].err != nil:
			t.Errorf("%s entry: %v", e.name, res[i].err)
		}
	}
	if got, want := f.AppliedIndex(), logs[len(logs)-1].Index; got != want {
		t.Errorf("AppliedIndex() = %d, want %d", got, want)
	}
	for _, id := range []string{"vol-1", "vol-2"} {
		if readVolume(t, f, id) == nil {
			t.Errorf("%s missing", id)
		}
	}
}

// ----------------------------------------------------------- allocation

// allocationProblems compares each server's allocated_bytes with the sum of
// the sizes of the volumes with a replica there, in any state (a replica
// marked faulty keeps its space until it is replaced or its volume goes)
// but one lost with its server's data (ServerRemoved), which counts
// against no server.
func allocationProblems(t testing.TB, f *FSM) []string {
	t.Helper()
	var problems []string
	err := f.View(func(r *Reader) error {
		servers, err := r.Servers()
		if err != nil {
			return err
		}
		vols, _, err := r.Volumes("", 0)
		if err != nil {
			return err
		}
		want := map[string]uint64{}
		for _, v := range vols {
			for _, rep := range v.Replicas {
				if rep.ServerRemoved {
					continue
				}
				sum, carry := bits.Add64(want[rep.ServerId], v.SizeBytes, 0)
				if carry != 0 {
					problems = append(problems, fmt.Sprintf("server %s: volumes sum to more than 2^64 bytes", rep.ServerId))
				}
				want[rep.ServerId] = sum
			}
		}
		for _, s := range servers {
			if s.AllocatedBytes != want[s.Id] {
				problems = append(problems, fmt.Sprintf("server %s: allocated_bytes %d, its replicas sum to %d", s.Id, s.AllocatedBytes, want[s.Id]))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return problems
}

func totalAllocated(t testing.TB, f *FSM) uint64 {
	t.Helper()
	var total uint64
	if err := f.View(func(r *Reader) error {
		servers, err := r.Servers()
		for _, s := range servers {
			total += s.AllocatedBytes
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return total
}

func TestFSMAllocationAccounting(t *testing.T) {
	f := openTestFSM(t, "")
	steps := []command{
		cmdRegisterServer("s1", "a", gib, nil),
		cmdRegisterServer("s2", "a", gib, nil),
		cmdRegisterServer("s3", "b", gib, nil),
		cmdRegisterServer("s4", "b", 0, nil),
		cmdCreateVolume("vol-a", "pvc-a", 10*mib, 3),
		cmdCreateVolume("vol-b", "pvc-b", 5000, 2),
		cmdCreateVolume("vol-c", "pvc-c", mib, 1),
		cmdCreateVolume("vol-d", "pvc-d", 2*mib, 4),
		cmdExpandVolume("vol-a", 20*mib),
		cmdExpandVolume("vol-c", mib-100), // no-op: rounds to the current size
		cmdCreateVolume("vol-b-again", "pvc-b", 5000, 2),
		cmdDeleteVolume("vol-b"),
		cmdExpandVolume("vol-d", 3*mib),
		cmdCreateVolume("vol-e", "pvc-e", 4*mib, 3),
		cmdAttachVolume("vol-e", "node-1", false),
		cmdSetReplicaState("vol-e", "vol-e-r1", storpb.ReplicaState_REPLICA_STATE_FAULTY, 1, 0),
		cmdSetReplicaState("vol-e", "vol-e-r1", storpb.ReplicaState_REPLICA_STATE_REBUILDING, 1, 0),
		cmdReplaceReplica("vol-a", "vol-a-r1", "", "vol-a-r4", false), // to the one server without a replica
		cmdReplaceReplica("vol-e", "vol-e-r1", "", "", true),
		cmdReplaceReplica("vol-e", "", "", "vol-e-r4", false),
		cmdDeleteVolume("vol-c"),
		cmdCreateVolume("vol-f", "pvc-f", 2*gib, 1), // fits only on s4, which reports no capacity
		cmdExpandVolume("vol-a", 2*gib),             // refused: capacity
	}
	for i, c := range steps {
		r := applyCommands(t, f, c)[0]
		t.Logf("step %d %v: err %v", i, c.Op, r.err)
		for _, p := range allocationProblems(t, f) {
			t.Errorf("after step %d (%v %v): %s", i, c.Op, c.Body, p)
		}
	}
	// vol-a 20 MiB x3, vol-d 3 MiB x4, vol-e 4 MiB x3, vol-f 2 GiB x1 (on
	// s4, the one server without a reported capacity).
	if got, want := totalAllocated(t, f), uint64(60*mib+12*mib+12*mib+2*gib); got != want {
		t.Errorf("total allocated %d, want %d", got, want)
	}
	if v := readVolume(t, f, "vol-f"); len(v.Replicas) != 1 || v.Replicas[0].ServerId != "s4" {
		t.Errorf("vol-f replicas %v, want one on s4", v.Replicas)
	}

	applyCommands(t, f, cmdDetachVolume("vol-e", ""))
	for _, id := range []string{"vol-a", "vol-d", "vol-e", "vol-f"} {
		if r := applyCommands(t, f, cmdDeleteVolume(id))[0]; r.err != nil {
			t.Fatalf("delete %s: %v", id, r.err)
		}
	}
	if got := totalAllocated(t, f); got != 0 {
		t.Errorf("total allocated %d with no volumes left", got)
	}
}

func TestFSMRemoveServerMarksReplicasFaulty(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, richWorkload()...)
	const gone = "s1"
	var beforeVols []*storpb.Volume
	var beforeServers []*storpb.Server
	if err := f.View(func(r *Reader) error {
		var err error
		if beforeVols, _, err = r.Volumes("", 0); err != nil {
			return err
		}
		beforeServers, err = r.Servers()
		return err
	}); err != nil {
		t.Fatal(err)
	}
	hit, miss := 0, 0
	for _, v := range beforeVols {
		if slices.Contains(replicaServers(v), gone) {
			hit++
		} else {
			miss++
		}
	}
	if hit == 0 || miss == 0 {
		t.Fatalf("fixture: %d volumes with a replica on %s, %d without; want some of each", hit, gone, miss)
	}

	r := applyCommands(t, f, cmdRemoveServer(gone))[0]
	if r.err != nil {
		t.Fatal(r.err)
	}
	if s, ok := r.msg.(*storpb.Server); !ok || s.Id != gone {
		t.Errorf("remove answered %v, want the removed server", r.msg)
	}
	err := f.View(func(rd *Reader) error {
		if _, err := rd.Server(gone); !errors.Is(err, ErrNotFound) {
			t.Errorf("removed server: %v, want ErrNotFound", err)
		}
		for _, s := range beforeServers {
			if s.Id == gone {
				continue
			}
			if got, err := rd.Server(s.Id); err != nil || !proto.Equal(got, s) {
				t.Errorf("server %s changed: %v -> %v (%v)", s.Id, s, got, err)
			}
		}
		for _, before := range beforeVols {
			got, err := rd.Volume(before.Id)
			if err != nil {
				return err
			}
			want := proto.Clone(before).(*storpb.Volume)
			bumped := false
			for i, rep := range want.Replicas {
				if rep.ServerId == gone && !rep.ServerRemoved {
					if !bumped {
						want.Generation++
						bumped = true
					}
					if rep.State == storpb.ReplicaState_REPLICA_STATE_HEALTHY {
						// It became unhealthy when its server was removed.
						if got.Replicas[i].UnhealthySinceUnixNano == 0 {
							t.Errorf("volume %s replica %s: no unhealthy-since time", before.Id, rep.Id)
						}
						rep.UnhealthySinceUnixNano = got.Replicas[i].UnhealthySinceUnixNano
					}
					// The replica state machine (replicastate.go): a new
					// state since now, and nothing to rebuild from (its data
					// went with its server).
					rep.State, rep.Generation = storpb.ReplicaState_REPLICA_STATE_FAULTY, want.Generation
					rep.StateSinceUnixNano = got.Replicas[i].StateSinceUnixNano
					if rep.StateSinceUnixNano == 0 {
						t.Errorf("volume %s replica %s: no state-since time", before.Id, rep.Id)
					}
					rep.RebuildFromGeneration, rep.RebuildResumeOffset, rep.RebuildDoneBytes, rep.RebuildTotalBytes = 0, 0, 0, 0
					rep.ServerRemoved = true
				}
			}
			if !proto.Equal(got, want) {
				t.Errorf("volume %s:\n\tgot  %v\n\twant %v", before.Id, got, want)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range allocationProblems(t, f) {
		t.Errorf("after removing %s: %s", gone, p)
	}

	// Removing again is refused; volumes with a faulty replica can still be
	// expanded and deleted, and only live servers are charged.
	if r := applyCommands(t, f, cmdRemoveServer(gone))[0]; !errors.Is(r.err, ErrNotFound) {
		t.Errorf("second remove: %v, want ErrNotFound", r.err)
	}
	for _, v := range beforeVols {
		if !slices.Contains(replicaServers(v), gone) || IsDeleted(v) {
			continue
		}
		// (Unless a snapshot of it is not yet cut: no volume is expanded
		// then.)
		pending := len(readVolume(t, f, v.Id).PendingSnapshotIds) > 0
		if r := applyCommands(t, f, cmdExpandVolume(v.Id, v.SizeBytes+mib))[0]; pending != errors.Is(r.err, ErrFailedPrecondition) || (!pending && r.err != nil) {
			t.Errorf("expand %s (snapshots pending: %v): %v", v.Id, pending, r.err)
		}
		for _, p := range allocationProblems(t, f) {
			t.Errorf("after expanding %s: %s", v.Id, p)
		}
	}
	applyCommands(t, f, cmdDetachVolume("vol-1", ""), cmdRecordCloneCopied("vol-5", "vol-5-r1"), cmdRecordCloneCopied("vol-5", "vol-5-r2"),
		cmdDeleteSnapshot("snap-1"), cmdDeleteSnapshot("snap-2"))
	for _, v := range beforeVols {
		if r := applyCommands(t, f, cmdDeleteVolume(v.Id))[0]; r.err != nil {
			t.Errorf("delete %s: %v", v.Id, r.err)
		}
	}
	// vol-7, deleted with a snapshot, is kept for it until it goes too.
	mustApply(t, f, cmdDeleteSnapshot("snap-7"))
	if got := totalAllocated(t, f); got != 0 {
		t.Errorf("total allocated %d with no volumes left", got)
	}
}

// TestFSMAllocationAfterServerRejoins: a removed server that registers again
// under its id (Leave, then Join) starts with nothing allocated: the
// replicas it held were lost with it. The faulty replicas that old volumes
// still name it in must not be charged to it when those volumes grow, nor
// credited back when they go.
func TestFSMAllocationAfterServerRejoins(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f,
		cmdRegisterServer("s1", "a", gib, nil),
		cmdRegisterServer("s2", "b", gib, nil),
		cmdRegisterServer("s3", "c", gib, nil),
		cmdCreateVolume("vol-old", "pvc-old", 100*mib, 3),   // a replica on every server
		cmdCreateVolume("vol-old2", "pvc-old2", 300*mib, 3), // and another
		cmdRemoveServer("s1"),
		cmdRegisterServer("s1", "a", gib, nil), // rejoins with nothing allocated
		cmdCreateVolumeReq("vol-new", &storpb.CreateVolumeRequest{
			Name: "pvc-new", SizeBytes: 10 * mib, ReplicaCount: 1,
			Accessibility: &storpb.TopologyRequirement{Requisite: []*storpb.Topology{topo("node", "s1")}},
		}),
	)
	allocated := func() uint64 {
		var s *storpb.Server
		if err := f.View(func(r *Reader) error {
			var err error
			s, err = r.Server("s1")
			return err
		}); err != nil {
			t.Fatal(err)
		}
		return s.AllocatedBytes
	}
	if got := allocated(); got != 10*mib {
		t.Fatalf("s1 allocated %d after rejoining and receiving vol-new, want %d", got, 10*mib)
	}
	// The leader replaces replicas whose server stayed away (here: only
	// removes it; the volume runs on two until one is added).
	var lost string
	for _, r := range readVolume(t, f, "vol-old2").Replicas {
		if r.ServerId == "s1" {
			lost = r.Id
		}
	}
	mustApply(t, f, cmdReplaceReplica("vol-old2", lost, "", "", true))
	if got := allocated(); got != 10*mib {
		t.Errorf("s1 allocated %d after vol-old2's lost replica on s1 was removed, want %d", got, 10*mib)
	}
	mustApply(t, f, cmdExpandVolume("vol-old", 200*mib))
	if got := allocated(); got != 10*mib {
		t.Errorf("s1 allocated %d after vol-old (whose replica on s1 was lost) grew by 100 MiB, want %d", got, 10*mib)
	}
	mustApply(t, f, cmdDeleteVolume("vol-old"))
	// Unambiguous whatever one counts: only vol-new is left, and it has
	// one healthy 10 MiB replica on s1.
	if got := allocated(); got != 10*mib {
		t.Errorf("s1 allocated %d with only vol-new (10 MiB, healthy) on it, want %d", got, 10*mib)
	}
	for _, p := range allocationProblems(t, f) {
		t.Errorf("after deleting vol-old: %s", p)
	}
}

// TestFSMHugeVolumeSizes: sizes near 2^64 are either refused or honoured;
// they must not wrap around to a smaller volume or corrupt the accounting.
func TestFSMHugeVolumeSizes(t *testing.T) {
	cases := []struct {
		name     string
		capacity uint64 // of each server; 0 is unlimited
		setup    []command
		cmd      command
		size     uint64 // requested
		volume   string
	}{
		{name: "create max uint64, capacity reported", capacity: gib,
			cmd: cmdCreateVolume("vol-h", "pvc-h", math.MaxUint64, 1), size: math.MaxUint64, volume: "vol-h"},
		{name: "create max uint64, unlimited servers",
			cmd: cmdCreateVolume("vol-h", "pvc-h", math.MaxUint64, 1), size: math.MaxUint64, volume: "vol-h"},
		{name: "create 2^63+1, unlimited servers",
			cmd: cmdCreateVolume("vol-h", "pvc-h", 1<<63+1, 1), size: 1<<63 + 1, volume: "vol-h"},
		{name: "expand to max uint64",
			setup: []command{cmdCreateVolume("vol-1", "pvc-1", mib, 1)},
			cmd:   cmdExpandVolume("vol-1", math.MaxUint64), size: math.MaxUint64, volume: "vol-1"},
		{name: "expand to 2^64-1MiB, unlimited servers",
			setup: []command{cmdCreateVolume("vol-1", "pvc-1", mib, 1)},
			cmd:   cmdExpandVolume("vol-1", math.MaxUint64-mib+1), size: math.MaxUint64 - mib + 1, volume: "vol-1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := openTestFSM(t, "")
			mustApply(t, f, cmdRegisterServer("s1", "a", tc.capacity, nil))
			mustApply(t, f, tc.setup...)
			before := dumpState(t, f)
			r := applyCommands(t, f, tc.cmd)[0]
			if r.err != nil {
				t.Logf("refused: %v", r.err)
				requireSameState(t, withoutApplied(before), withoutApplied(dumpState(t, f)), "state after a refused command")
				return
			}
			v := readVolume(t, f, tc.volume)
			if v.SizeBytes < tc.size || v.SizeBytes%BlockSize != 0 {
				t.Errorf("asked for %d bytes, got a volume of %d bytes", tc.size, v.SizeBytes)
			}
			for _, p := range allocationProblems(t, f) {
				t.Errorf("%s", p)
			}
		})
	}
}

// ----------------------------------------------------------- concurrency

// TestFSMConcurrentViews: readers on other goroutines always see a state
// and an applied index that belong together, across applies and a restore.
func TestFSMConcurrentViews(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdRegisterServer("s1", "", 0, nil))
	base := f.AppliedIndex()
	var image []byte

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				err := f.View(func(r *Reader) error {
					vols, _, err := r.Volumes("", 0)
					if err != nil {
						return err
					}
					if idx := r.AppliedIndex(); uint64(len(vols)) != idx-base {
						return fmt.Errorf("applied index %d with %d volumes, want %d", idx, len(vols), idx-base)
					}
					return nil
				})
				if err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	for i := range 60 {
		mustApply(t, f, cmdCreateVolume(fmt.Sprintf("vol-%03d", i), fmt.Sprintf("pvc-%03d", i), BlockSize, 1))
		if i == 20 {
			image = snapshotBytes(t, f)
		}
	}
	if err := f.Restore(io.NopCloser(bytes.NewReader(image))); err != nil {
		t.Error(err)
	}
	for i := 21; i < 40; i++ {
		mustApply(t, f, cmdCreateVolume(fmt.Sprintf("vol-%03d", i), fmt.Sprintf("pvc-%03d", i), BlockSize, 1))
	}
	close(stop)
	wg.Wait()
	if got, want := f.AppliedIndex(), base+40; got != want {
		t.Errorf("AppliedIndex() = %d, want %d", got, want)
	}
}

// TestDetachRaisesTheEpoch: a detach fences the engine that held the
// volume (and any zombie of it) by a new epoch, an idempotent detach (not
// attached there) changes nothing, and a fence of a detached volume raises
// the epoch without attaching it.
func TestDetachRaisesTheEpoch(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f,
		cmdInitCluster("c1"),
		cmdRegisterServer("s1", "a", gib, nil),
		cmdRegisterServer("s2", "b", gib, nil),
		cmdCreateVolume("vol-1", "pvc-1", mib, 2),
		cmdAttachVolume("vol-1", "node-1", false), // epoch 1
	)
	steps := []struct {
		what     string
		cmd      command
		epoch    uint64
		attached bool
	}{
		{"detach from another node: no-op", cmdDetachVolume("vol-1", "node-2"), 1, true},
		{"detach", cmdDetachVolume("vol-1", "node-1"), 2, false},
		{"detach again: no-op", cmdDetachVolume("vol-1", "node-1"), 2, false},
		{"detach again, any node: no-op", cmdDetachVolume("vol-1", ""), 2, false},
		{"fence detached", cmdFenceDetached("vol-1", ""), 3, false},
		{"fence detached again", cmdFenceDetached("vol-1", ""), 4, false},
		{"attach", cmdAttachVolume("vol-1", "node-2", false), 5, true},
		{"detach, any node", cmdDetachVolume("vol-1", ""), 6, false},
	}
	for _, s := range steps {
		r := mustApply(t, f, s.cmd)[0]
		v := readVolume(t, f, "vol-1")
		if v.Epoch != s.epoch || (v.Attachment != nil) != s.attached {
			t.Fatalf("%s: epoch %d, attachment %v; want epoch %d, attached %v", s.what, v.Epoch, v.Attachment, s.epoch, s.attached)
		}
		if got := r.msg.(*storpb.Volume).GetEpoch(); got != s.epoch {
			t.Fatalf("%s: answered epoch %d, want %d", s.what, got, s.epoch)
		}
	}
}

// A server's Kubernetes node is committed when it registers and when it
// changes (a pod rescheduled to another node heartbeats with the new one).
func TestRegisterServerKubernetesNode(t *testing.T) {
	f := openTestFSM(t, "")
	reg := func(node string) command {
		c := cmdRegisterServer("s1", "a", 1<<30, nil)
		c.Body.(*storpb.Server).KubernetesNode = node
		return c
	}
	get := func() *storpb.Server {
		var s *storpb.Server
		if err := f.View(func(r *Reader) error { var err error; s, err = r.Server("s1"); return err }); err != nil {
			t.Fatal(err)
		}
		return s
	}
	mustApply(t, f, cmdInitCluster("c1"), reg("worker-1"))
	cur := get()
	if cur.GetKubernetesNode() != "worker-1" {
		t.Fatalf("registered Kubernetes node %q, want worker-1", cur.GetKubernetesNode())
	}
	moved := proto.Clone(cur).(*storpb.Server)
	moved.KubernetesNode = "worker-2"
	if !serverInfoChanged(cur, moved) {
		t.Error("a heartbeat from another Kubernetes node is not a change to commit")
	}
	mustApply(t, f, reg("worker-2"))
	if got := get().GetKubernetesNode(); got != "worker-2" {
		t.Errorf("re-registered Kubernetes node %q, want worker-2", got)
	}
}

// TestFSMRegisterKeepsTheServersDataDir: a record without a data dir (a
// server of an older version) takes the first a register names; a
// register without one keeps the record's; one naming another is
// refused, as the leader refuses it before proposing (dataDirMatches):
// a record is named anew only once its server is removed.
func TestFSMRegisterKeepsTheServersDataDir(t *testing.T) {
	f := openTestFSM(t, "")
	register := func(id, dir string) command {
		c := cmdRegisterServer(id, "", gib, nil)
		c.Body.(*storpb.Server).DataDirId = dir
		return c
	}
	dirOf := func(id string) string { return readServer(t, f, id).DataDirId }
	mustApply(t, f, register("s1", "d1"), register("s2", ""))
	for _, step := range []struct {
		cmd      command
		id, want string
	}{
		{register("s1", ""), "s1", "d1"},
		{register("s1", "d1"), "s1", "d1"},
		{register("s2", "d2"), "s2", "d2"},
	} {
		mustApply(t, f, step.cmd)
		if got := dirOf(step.id); got != step.want {
			t.Errorf("%s's data dir after registering with %q: %q, want %q", step.id, step.cmd.Body.(*storpb.Server).DataDirId, got, step.want)
		}
	}
	before := dumpState(t, f)
	if r := applyCommands(t, f, register("s1", "d-other"))[0]; !errors.Is(r.err, ErrDataDirReplaced) {
		t.Errorf("s1 registering with another data dir: %v, want ErrDataDirReplaced", r.err)
	}
	requireSameState(t, withoutApplied(before), withoutApplied(dumpState(t, f)), "state after a refused register")
	mustApply(t, f, cmdRemoveServer("s1"), register("s1", "d-other"))
	if got := dirOf("s1"); got != "d-other" {
		t.Errorf("s1's data dir after it was removed and registered with d-other: %q", got)
	}
}

// TestFSMAReplacementMayGoOnTheServerItsLostReplicaWasOn: a server removed
// (its data lost: a failed disk) that joins again under its id leaves its
// old replicas faulty and flagged ServerRemoved. Their replacements could
// not go on it, as if it held them: on a cluster of as many servers as
// the volume has replicas (three), the volume stayed one short for good
// (the documented way to replace a failed data disk). A lost replica now
// takes no room on its server.
func TestFSMAReplacementMayGoOnTheServerItsLostReplicaWasOn(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f,
		cmdRegisterServer("s1", "a", gib, nil),
		cmdRegisterServer("s2", "b", gib, nil),
		cmdRegisterServer("s3", "c", gib, nil),
		cmdCreateVolume("vol-1", "pvc-1", 100*mib, 3),
		cmdRemoveServer("s2"),
		cmdRegisterServer("s2", "b", gib, nil),
	)
	var lost string
	for _, r := range readVolume(t, f, "vol-1").Replicas {
		if r.ServerId == "s2" {
			lost = r.Id
		}
	}
	// Without the leader's flag (servers of an older version run), as
	// before: no room.
	if r := applyCommands(t, f, cmdReplaceReplica("vol-1", lost, "", "vol-1-new", false))[0]; !errors.Is(r.err, ErrInsufficientServers) {
		t.Fatalf("a replacement without lost_replica_frees_its_server: %v, want ErrInsufficientServers as before", r.err)
	}
	replace := cmdReplaceReplica("vol-1", lost, "", "vol-1-new", false)
	replace.Body.(*storpb.ReplaceReplicaRequest).LostReplicaFreesItsServer = true
	mustApply(t, f, replace)
	v := readVolume(t, f, "vol-1")
	if r := replicaIn(v, "vol-1-new"); r == nil || r.ServerId != "s2" || r.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING || r.RebuildFromGeneration != 0 {
		t.Errorf("vol-1's replacement of its lost replica: %v; want a full rebuild on s2, the only server without a replica of it", r)
	}
	if replicaIn(v, lost) != nil {
		t.Errorf("the lost replica %s is still in vol-1: %v", lost, v.Replicas)
	}
	for _, p := range allocationProblems(t, f) {
		t.Errorf("after the replacement: %s", p)
	}
}
