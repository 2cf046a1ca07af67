package raftstore

import (
	"bytes"
	"errors"
	"math"
	"testing"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// TestOpValuesArePinned pins the op numbers: they are part of the Raft log
// format, and a renumbered op would make old logs replay as other commands.
func TestOpValuesArePinned(t *testing.T) {
	want := []struct {
		op   op
		val  uint8
		name string
	}{
		{opInitCluster, 1, "init-cluster"},
		{opRegisterServer, 2, "register-server"},
		{opSetServerState, 3, "set-server-state"},
		{opRemoveServer, 4, "remove-server"},
		{opCreateVolume, 5, "create-volume"},
		{opDeleteVolume, 6, "delete-volume"},
		{opExpandVolume, 7, "expand-volume"},
		{opAttachVolume, 8, "attach-volume"},
		{opDetachVolume, 9, "detach-volume"},
		{opCreateSnapshot, 10, "create-snapshot"},
		{opDeleteSnapshot, 11, "delete-snapshot"},
		{opSetReplicaState, 12, "set-replica-state"},
		{opReplaceReplica, 13, "replace-replica"},
		{opRecordCut, 14, "record-snapshot-cut"},
		{opRecordCloneCopy, 15, "record-clone-copied"},
		{opRegisterNode, 16, "register-node"},
		{opRepairReplica, 17, "repair-replica"},
		{opSetClusterConfig, 18, "set-cluster-config"},
		{opCordonServer, 19, "cordon-server"},
	}
	if len(opNames) != len(want) {
		t.Errorf("opNames has %d ops, this test knows %d: add the new op here and to commandRoundTripCases", len(opNames), len(want))
	}
	for _, w := range want {
		if uint8(w.op) != w.val {
			t.Errorf("%s = %d, want %d (log format)", w.name, uint8(w.op), w.val)
		}
		if got := w.op.String(); got != w.name {
			t.Errorf("op(%d).String() = %q, want %q", w.val, got, w.name)
		}
	}
	if got := op(200).String(); got != "op(200)" {
		t.Errorf("op(200).String() = %q, want op(200)", got)
	}
}

// commandRoundTripCases holds one command per op, with every body field
// that matters set, and what decoding its encoding must give.
func commandRoundTripCases() []struct {
	name string
	cmd  command
	want command // zero: same as cmd
} {
	return []struct {
		name string
		cmd  command
		want command
	}{
		{name: "init-cluster", cmd: command{Op: opInitCluster, At: 1, ID: "cluster-0d1f"}},
		{name: "register-server", cmd: command{Op: opRegisterServer, At: 1_700_000_000_000_000_000, Body: &storpb.Server{
			Id: "s1", Address: "10.0.0.1:7000", RaftAddress: "10.0.0.1:7001", DataAddress: "10.0.0.1:7002",
			Zone: "a", Labels: map[string]string{"rack": "r1", "disk": "nvme"}, CapacityBytes: 1 << 40,
			AllocatedBytes: 7, State: storpb.ServerState_SERVER_STATE_UP, LastSeenUnixNano: 3, JoinedUnixNano: 2,
		}}},
		{name: "set-server-state", cmd: command{Op: opSetServerState, At: 2, Body: &storpb.Server{
			Id: "s1", State: storpb.ServerState_SERVER_STATE_DOWN, LastSeenUnixNano: 99,
		}}},
		{name: "remove-server", cmd: command{Op: opRemoveServer, At: 3, ID: "s1"}},
		{name: "create-volume", cmd: command{Op: opCreateVolume, At: 4, ID: "vol-6c2a", Body: &storpb.CreateVolumeRequest{
			Name: "pvc-1", SizeBytes: 10 << 20, ReplicaCount: 3,
			Parameters:    map[string]string{"fsType": "ext4", "b": "2"},
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: "snap-1"}},
			Accessibility: &storpb.TopologyRequirement{
				Requisite: []*storpb.Topology{{Segments: map[string]string{"zone": "a"}}, {Segments: map[string]string{"zone": "b"}}},
				Preferred: []*storpb.Topology{{Segments: map[string]string{"node": "s2", "zone": "a"}}},
			},
		}}},
		{name: "create-volume from volume", cmd: command{Op: opCreateVolume, At: 4, ID: "vol-2", Body: &storpb.CreateVolumeRequest{
			Name: "clone", SizeBytes: 1, ReplicaCount: 1,
			ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-6c2a"}},
		}}},
		{name: "delete-volume", cmd: command{Op: opDeleteVolume, At: 5, Body: &storpb.VolumeRef{Name: "pvc-1"}}},
		{name: "expand-volume", cmd: command{Op: opExpandVolume, At: 6, Body: &storpb.ExpandVolumeRequest{
			Volume: &storpb.VolumeRef{Id: "vol-6c2a"}, SizeBytes: 20 << 20,
		}}},
		{name: "attach-volume", cmd: command{Op: opAttachVolume, At: 7, Body: &storpb.AttachVolumeRequest{
			Volume: &storpb.VolumeRef{Id: "vol-6c2a"}, NodeId: "node-1", Mode: storpb.AccessMode_ACCESS_MODE_READ_ONLY, Takeover: true,
		}}},
		{name: "detach-volume", cmd: command{Op: opDetachVolume, At: 8, Body: &storpb.DetachVolumeRequest{
			Volume: &storpb.VolumeRef{Name: "pvc-1"}, NodeId: "node-1",
		}}},
		{name: "create-snapshot", cmd: command{Op: opCreateSnapshot, At: 9, ID: "snap-9", Body: &storpb.CreateSnapshotRequest{
			VolumeId: "vol-6c2a", Name: "nightly",
		}}},
		{name: "delete-snapshot", cmd: command{Op: opDeleteSnapshot, At: 10, Body: &storpb.SnapshotRef{Id: "snap-9"}}},
		{name: "set-replica-state", cmd: command{Op: opSetReplicaState, At: 11, Body: &storpb.SetReplicaStateRequest{
			VolumeId: "vol-6c2a", ReplicaId: "vol-6c2a-r2", State: storpb.ReplicaState_REPLICA_STATE_HEALTHY,
			Epoch: 4, Generation: 9, Reason: "rebuild complete", RebuildDoneBytes: 5, RebuildTotalBytes: 10,
		}}},
		{name: "replace-replica", cmd: command{Op: opReplaceReplica, At: 12, ID: "vol-6c2a-r4", Body: &storpb.ReplaceReplicaRequest{
			Volume: &storpb.VolumeRef{Id: "vol-6c2a"}, ReplicaId: "vol-6c2a-r2", ServerId: "s3", RemoveOnly: true,
		}}},
		{name: "repair-replica", cmd: command{Op: opRepairReplica, At: 12, ID: "vol-6c2a-r5", Body: &storpb.ReplaceReplicaRequest{
			Volume: &storpb.VolumeRef{Id: "vol-6c2a"}, ReplicaId: "vol-6c2a-r2",
		}}},
		{name: "record-snapshot-cut", cmd: command{Op: opRecordCut, At: 13, Body: &storpb.RecordSnapshotCutRequest{
			SnapshotId: "snap-9", Epoch: 4, CutReplicaIds: []string{"vol-6c2a-r1", "vol-6c2a-r2"},
			MissedReplicaIds: []string{"vol-6c2a-r3"}, Reason: "not healthy at the cut",
		}}},
		{name: "record-clone-copied", cmd: command{Op: opRecordCloneCopy, At: 14, Body: &storpb.RecordCloneCopiedRequest{
			VolumeId: "vol-7d", ReplicaId: "vol-7d-r1",
		}}},
		{name: "register-node", cmd: command{Op: opRegisterNode, At: 15, Body: &storpb.Node{
			Id: "worker-7", Zone: "zone-a", Labels: map[string]string{"pool": "gpu"},
		}}},
		{name: "set-cluster-config", cmd: command{Op: opSetClusterConfig, At: 16, Body: &storpb.ClusterConfig{
			ReplaceAfterSeconds: 120, OverProvisioningPercent: 300,
		}}},
		{name: "cordon-server", cmd: command{Op: opCordonServer, At: 17, Body: &storpb.Server{Id: "s2", Cordoned: true}}},
		// Edge values of the header.
		{name: "negative time, long id", cmd: command{Op: opInitCluster, At: math.MinInt64, ID: string(bytes.Repeat([]byte("x"), 300))}},
		{name: "max time, empty id", cmd: command{Op: opRemoveServer, At: math.MaxInt64}},
		{name: "non-UTF-8 id", cmd: command{Op: opRemoveServer, ID: "\xff\xfe"}},
		// A body op without a body decodes to the empty message of its type,
		// which is what the FSM's type assertions rely on.
		{
			name: "create-volume without body",
			cmd:  command{Op: opCreateVolume, At: 11, ID: "v"},
			want: command{Op: opCreateVolume, At: 11, ID: "v", Body: &storpb.CreateVolumeRequest{}},
		},
		{
			name: "delete-snapshot without body",
			cmd:  command{Op: opDeleteSnapshot},
			want: command{Op: opDeleteSnapshot, Body: &storpb.SnapshotRef{}},
		},
	}
}

// commandsEqual compares commands field by field, bodies with proto.Equal.
func commandsEqual(a, b command) bool {
	if a.Op != b.Op || a.At != b.At || a.ID != b.ID {
		return false
	}
	if a.Body == nil || b.Body == nil {
		return a.Body == nil && b.Body == nil
	}
	return proto.Equal(a.Body, b.Body)
}

func TestCommandRoundTrip(t *testing.T) {
	covered := map[op]bool{}
	for _, tc := range commandRoundTripCases() {
		t.Run(tc.name, func(t *testing.T) {
			want := tc.want
			if want.Op == 0 {
				want = tc.cmd
			}
			b, err := tc.cmd.encode()
			if err != nil {
				t.Fatalf("encode: %v", err)
			}
			got, err := decodeCommand(b)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if !commandsEqual(got, want) {
				t.Fatalf("decode(encode(c)) = %+v, want %+v", got, want)
			}
			// The encoding is deterministic: the same command, encoded
			// again (maps included), gives the same bytes.
			for range 5 {
				again, err := tc.cmd.encode()
				if err != nil || !bytes.Equal(again, b) {
					t.Fatalf("second encoding differs: %x vs %x (err %v)", again, b, err)
				}
			}
			covered[tc.cmd.Op] = true
		})
	}
	for o := range opNames {
		if !covered[o] {
			t.Errorf("no round-trip case for %v", o)
		}
	}
}

// TestCommandEncodingGolden pins the byte layout: version, op, at (big
// endian), uvarint id length, id, body.
func TestCommandEncodingGolden(t *testing.T) {
	c := command{Op: opDeleteVolume, At: 0x0102030405060708, ID: "ab", Body: &storpb.VolumeRef{Id: "v"}}
	got, err := c.encode()
	if err != nil {
		t.Fatal(err)
	}
	want := []byte{
		1,                                              // version
		6,                                              // opDeleteVolume
		0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, // at
		2, 'a', 'b', // id
		0x0a, 1, 'v', // VolumeRef{id: "v"}
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("encode = %x\nwant     %x", got, want)
	}
}

func TestDecodeCommandRejects(t *testing.T) {
	valid, err := command{Op: opCreateVolume, At: 1, ID: "vol", Body: &storpb.CreateVolumeRequest{Name: "n", SizeBytes: 1, ReplicaCount: 1}}.encode()
	if err != nil {
		t.Fatal(err)
	}
	header := func(o byte) []byte { return []byte{1, o, 0, 0, 0, 0, 0, 0, 0, 0} }
	cases := []struct {
		name string
		b    []byte
	}{
		{"nil", nil},
		{"empty", []byte{}},
		{"version only", []byte{1}},
		{"short header", valid[:9]},
		{"header without id length", valid[:10]},
		{"wrong version", append([]byte{2}, valid[1:]...)},
		{"version zero", append([]byte{0}, valid[1:]...)},
		{"op zero", append(header(0), 0)},
		{"unknown op", append(header(byte(len(opNames)+1)), 0)},
		{"op 255", append(header(255), 0)},
		{"id longer than the entry", append(header(byte(opRemoveServer)), 5, 'a', 'b')},
		{"id length overflows", append(header(byte(opRemoveServer)), 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01)},
		{"id length varint too long", append(header(byte(opRemoveServer)), 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01)},
		{"truncated varint", append(header(byte(opRemoveServer)), 0x80)},
		{"body is not protobuf", append(header(byte(opCreateVolume)), 0, 0xff, 0xff, 0xff)},
		{"body truncated", valid[:len(valid)-1]},
		{"body with invalid UTF-8 string", append(header(byte(opDeleteVolume)), 0, 0x0a, 2, 0xff, 0xfe)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, err := decodeCommand(tc.b)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("decodeCommand(%x) = %+v, %v; want ErrCorrupt", tc.b, c, err)
			}
		})
	}
}

// FuzzDecodeCommand: decoding arbitrary bytes never panics, fails only with
// ErrCorrupt, and whatever decodes re-encodes to a command that decodes
// equal (and to the same bytes again: the encoding is a fixed point).
func FuzzDecodeCommand(f *testing.F) {
	for _, tc := range commandRoundTripCases() {
		b, err := tc.cmd.encode()
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{1, 5, 0, 0, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := decodeCommand(b)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("decodeCommand(%x): %v, want ErrCorrupt", b, err)
			}
			return
		}
		enc, err := c.encode()
		if err != nil {
			t.Fatalf("decoded %+v from %x but cannot encode it: %v", c, b, err)
		}
		c2, err := decodeCommand(enc)
		if err != nil {
			t.Fatalf("re-encoding %x of %+v does not decode: %v", enc, c, err)
		}
		if !commandsEqual(c, c2) {
			t.Fatalf("decode(encode(decode(%x))) = %+v, want %+v", b, c2, c)
		}
		enc2, err := c2.encode()
		if err != nil || !bytes.Equal(enc, enc2) {
			t.Fatalf("encoding is not a fixed point: %x then %x (err %v)", enc, enc2, err)
		}
	})
}
