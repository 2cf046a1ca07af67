package server

import (
	"context"
	"errors"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/replica/wire"
)

// TestCopySourceAddress: the target's server reads a copy's source only
// where its own applied metadata says: its replica is rebuilding here, and
// the source is a healthy replica of the same volume, on a server whose
// address the metadata gives. Anything else is a refusal that catching up
// may lift, never an address from the request.
func TestCopySourceAddress(t *testing.T) {
	meta := func(edit func(v *storpb.Volume)) *fakeMeta {
		m := testMeta() // v1: r1 on s1, r2 on s2; c1.r0 on s2 (another volume)
		m.addrs = map[string]string{"s1": "10.0.0.1:7001", "s2": "10.0.0.2:7001"}
		m.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
		if edit != nil {
			edit(m.vols[testVol])
		}
		return m
	}
	into := func(replica string) wire.OpenRequest {
		return wire.OpenRequest{Replica: replica, Volume: testVol, Node: "node-a", Epoch: 4, Purpose: wire.PurposeAttach}
	}
	for _, tc := range []struct {
		name   string
		meta   *fakeMeta
		me     string
		target wire.OpenRequest
		source string
		want   string // "" : refused
	}{
		{"healthy source", meta(nil), "s2", into("r2"), "r1", "10.0.0.1:7001"},
		{"target on another server", meta(nil), "s1", into("r2"), "r1", ""},
		{"target not rebuilding", meta(func(v *storpb.Volume) { v.Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_HEALTHY }), "s2", into("r2"), "r1", ""},
		{"source not healthy", meta(func(v *storpb.Volume) { v.Replicas[0].State = storpb.ReplicaState_REPLICA_STATE_FAULTY }), "s2", into("r2"), "r1", ""},
		{"source of another volume", meta(nil), "s2", into("r2"), "c1.r0", ""},
		{"source unknown", meta(nil), "s2", into("r2"), "r9", ""},
		{"source removed with its server", meta(func(v *storpb.Volume) { v.Replicas[0].ServerRemoved = true }), "s2", into("r2"), "r1", ""},
		{"volume unknown", meta(nil), "s2", wire.OpenRequest{Replica: "r2", Volume: "v9"}, "r1", ""},
		{"source's server unknown", meta(func(v *storpb.Volume) { v.Replicas[0].ServerId = "s7" }), "s2", into("r2"), "r1", ""},
		{"source of a clone, filled", meta(func(v *storpb.Volume) {
			v.State, v.CloneDoneReplicaIds = storpb.VolumeState_VOLUME_STATE_CREATING, []string{"r1"}
		}), "s2", into("r2"), "r1", "10.0.0.1:7001"},
		{"source of a clone, not yet filled", meta(func(v *storpb.Volume) { v.State = storpb.VolumeState_VOLUME_STATE_CREATING }), "s2", into("r2"), "r1", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr, err := copySourceAddress(tc.meta, tc.me, tc.target, tc.source)
			if tc.want != "" {
				if err != nil || addr != tc.want {
					t.Fatalf("= %q, %v; want %q", addr, err, tc.want)
				}
				return
			}
			if err == nil || !errors.Is(err, wire.ErrDenied) || !errors.Is(err, errLagging) {
				t.Fatalf("= %q, %v; want a refusal that catching up may lift", addr, err)
			}
		})
	}
}

// TestCopySourceReadsEndWithTheSourcesHealth: a rebuild-source handle's
// reads are refused once its replica is no longer healthy, or its opener's
// server no longer holds a rebuilding replica, though the handle stays
// open; after catching up, not on a lagging view alone.
func TestCopySourceReadsEndWithTheSourcesHealth(t *testing.T) {
	ctx := context.Background()
	m := testMeta()
	m.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	l := &laggingAccess{applied: m}
	g, err := l.access().Open(ctx, wire.Peer{}, wire.OpenRequest{Replica: "r1", Volume: testVol, Node: "s2", Epoch: 4, Purpose: wire.PurposeRebuildSource})
	if err != nil {
		t.Fatal(err)
	}
	read := wire.Request{Op: wire.OpRead, Epoch: 4}
	if err := g.Allow(ctx, read); err != nil {
		t.Fatalf("read of a healthy source: %v", err)
	}
	for _, tc := range []struct {
		name string
		edit func(v *storpb.Volume)
	}{
		{"source faulty", func(v *storpb.Volume) { v.Replicas[0].State = storpb.ReplicaState_REPLICA_STATE_FAULTY }},
		{"target healthy", func(v *storpb.Volume) { v.Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_HEALTHY }},
		{"source removed", func(v *storpb.Volume) { v.Replicas = v.Replicas[1:] }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			changed := testMeta()
			changed.vols[testVol].Replicas[1].State = storpb.ReplicaState_REPLICA_STATE_REBUILDING
			tc.edit(changed.vols[testVol])
			l.mu.Lock()
			l.applied, l.catchUps = changed, 0
			l.mu.Unlock()
			if err := g.Allow(ctx, read); !errors.Is(err, wire.ErrDenied) {
				t.Fatalf("read: %v, want ErrDenied", err)
			}
			if l.catchUps == 0 {
				t.Fatal("refused without catching up")
			}
		})
	}
}
