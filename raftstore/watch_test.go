package raftstore

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// ------------------------------------------------------------- watching

const watchTimeout = 5 * time.Second

func recvEvent(t *testing.T, ch <-chan VolumeEvent) VolumeEvent {
	t.Helper()
	select {
	case ev, ok := <-ch:
		if !ok {
			t.Fatal("watch channel closed, want an event")
		}
		return ev
	case <-time.After(watchTimeout):
		t.Fatal("no watch event")
	}
	panic("unreachable")
}

// drainUntilClosed reads ch until it closes and returns what it read.
func drainUntilClosed(t *testing.T, ch <-chan VolumeEvent) []VolumeEvent {
	t.Helper()
	var evs []VolumeEvent
	deadline := time.After(watchTimeout)
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				return evs
			}
			evs = append(evs, ev)
		case <-deadline:
			t.Fatalf("watch channel not closed; read %d events", len(evs))
		}
	}
}

func checkEvent(t *testing.T, got VolumeEvent, index uint64, vol *storpb.Volume, deleted bool) {
	t.Helper()
	if got.Index != index || got.Deleted != deleted || (vol == nil) != (got.Volume == nil) ||
		(vol != nil && !proto.Equal(got.Volume, vol)) {
		t.Fatalf("event {index %d, deleted %v, volume %v}\nwant  {index %d, deleted %v, volume %v}",
			got.Index, got.Deleted, got.Volume, index, deleted, vol)
	}
}

// watchFixture: 3 servers and vol-1 with a replica on each.
func watchFixture(t *testing.T) *FSM {
	f := openTestFSM(t, "")
	mustApply(t, f, watchFixtureCommands()...)
	return f
}

func watchFixtureCommands() []command {
	return []command{
		cmdRegisterServer("s1", "a", 0, nil),
		cmdRegisterServer("s2", "b", 0, nil),
		cmdRegisterServer("s3", "c", 0, nil),
		cmdCreateVolume("vol-1", "pvc-1", mib, 3),
	}
}

func TestFSMWatch(t *testing.T) {
	f := watchFixture(t)
	ch, cancel := f.Watch("vol-1")
	defer cancel()
	checkEvent(t, recvEvent(t, ch), f.AppliedIndex(), readVolume(t, f, "vol-1"), false)

	type want struct {
		index   uint64
		vol     *storpb.Volume
		deleted bool
	}
	var wants []want
	for _, step := range []struct {
		cmd   command
		event bool
	}{
		{cmdAttachVolume("vol-1", "node-1", false), true},
		{cmdExpandVolume("vol-1", 2*mib), true},
		{cmdCreateVolume("vol-2", "pvc-2", mib, 1), false},
		{cmdAttachVolume("vol-2", "node-1", false), false},
		{cmdCreateSnapshot("snap-1", "vol-1", "snap-1"), true}, // the volume names it pending: the engine cuts it
		{cmdDeleteSnapshot("snap-1"), true},                    // and no longer
		{cmdRegisterServer("s4", "d", 0, nil), false},
		{cmdAttachVolume("vol-1", "node-2", true), true},
		{cmdAttachVolume("vol-1", "node-3", false), false},                                               // refused
		{cmdSetReplicaState("vol-1", "vol-1-r1", storpb.ReplicaState_REPLICA_STATE_FAULTY, 1, 0), false}, // refused: stale epoch
		{cmdSetReplicaState("vol-1", "vol-1-r1", storpb.ReplicaState_REPLICA_STATE_FAULTY, 2, 0), true},
		{cmdRemoveServer("s3"), true}, // vol-1's replica there turns faulty
		{cmdDetachVolume("vol-1", ""), true},
		{cmdDeleteVolume("vol-1"), true},
	} {
		r := applyCommands(t, f, step.cmd)[0]
		if !step.event {
			continue
		}
		if r.err != nil {
			t.Fatalf("%v: %v", step.cmd.Op, r.err)
		}
		w := want{index: f.AppliedIndex()}
		switch step.cmd.Op {
		case opDeleteVolume:
			w.deleted = true
		case opRemoveServer, opCreateSnapshot, opDeleteSnapshot:
			w.vol = readVolume(t, f, "vol-1")
		default:
			w.vol = r.msg.(*storpb.Volume)
		}
		wants = append(wants, w)
	}
	for _, w := range wants {
		checkEvent(t, recvEvent(t, ch), w.index, w.vol, w.deleted)
	}
	cancel()
	if extra := drainUntilClosed(t, ch); len(extra) > 0 {
		t.Fatalf("events after the last change: %+v", extra)
	}
	if f.hub.any() {
		t.Error("hub still has watchers after cancel")
	}
	cancel() // twice is harmless
}

func TestFSMWatchUnknownVolume(t *testing.T) {
	f := watchFixture(t)
	ch, cancel := f.Watch("vol-new")
	defer cancel()
	checkEvent(t, recvEvent(t, ch), f.AppliedIndex(), nil, true)
	r := mustApply(t, f, cmdCreateVolume("vol-new", "pvc-new", mib, 2))[0]
	checkEvent(t, recvEvent(t, ch), f.AppliedIndex(), r.msg.(*storpb.Volume), false)
}

func TestFSMWatchEndsOnCancelAndClose(t *testing.T) {
	f := watchFixture(t)
	ch1, cancel1 := f.Watch("vol-1")
	ch2, cancel2 := f.Watch("vol-1")
	defer cancel2()
	recvEvent(t, ch1)
	recvEvent(t, ch2)
	cancel1()
	drainUntilClosed(t, ch1)
	// The other watcher of the same volume goes on.
	mustApply(t, f, cmdAttachVolume("vol-1", "node-1", false))
	if ev := recvEvent(t, ch2); ev.Volume.GetEpoch() != 1 {
		t.Fatalf("event %+v, want epoch 1", ev)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	drainUntilClosed(t, ch2)
}

// TestFSMWatchSlowWatcherIsDropped: a watcher that does not read must not
// hold up ApplyBatch; it is dropped, and its channel closes once it has
// read what was buffered.
func TestFSMWatchSlowWatcherIsDropped(t *testing.T) {
	// No Close in a cleanup, no deferred cancel, no logging to t: if
	// ApplyBatch blocks on the watcher, those would block or log after the
	// test too, and turn this test's failure into a hang.
	f, err := OpenFSM(filepath.Join(t.TempDir(), "meta.db"), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	mustApply(t, f, watchFixtureCommands()...)
	ch, cancel := f.Watch("vol-1")

	total := 3 * watchBuffer
	first := f.AppliedIndex() + 1
	var cmds []command
	for i := range total {
		cmds = append(cmds, cmdAttachVolume("vol-1", fmt.Sprintf("node-%d", i%2), true))
	}
	logs := commandLogs(t, first, cmds...)
	done := make(chan []interface{}, total)
	go func() {
		for _, l := range logs {
			done <- f.ApplyBatch([]*raft.Log{l})
		}
		close(done)
	}()
	deadline := time.After(10 * time.Second)
	for n := 0; ; n++ {
		var out []interface{}
		var ok bool
		select {
		case out, ok = <-done:
		case <-deadline:
			t.Fatalf("ApplyBatch blocked by a watcher that does not read (after %d entries)", n)
		}
		if !ok {
			break
		}
		if r, _ := out[0].(result); r.err != nil {
			t.Fatalf("attach %d: %v", n, r.err)
		}
	}
	if f.hub.any() {
		t.Error("the slow watcher is still subscribed")
	}
	evs := drainUntilClosed(t, ch)
	if len(evs) >= total+1 {
		t.Fatalf("read %d events from a watcher that fell %d behind; it was never dropped", len(evs), total)
	}
	for i := 1; i < len(evs); i++ {
		if evs[i].Index <= evs[i-1].Index {
			t.Fatalf("event %d has index %d after %d", i, evs[i].Index, evs[i-1].Index)
		}
	}
	t.Logf("dropped after delivering %d of %d events (watchBuffer %d)", len(evs), total+1, watchBuffer)
	// Watching again starts from the current state: nothing is lost.
	ch2, cancel2 := f.Watch("vol-1")
	ev := recvEvent(t, ch2)
	if ev.Index != f.AppliedIndex() || ev.Volume.GetEpoch() != uint64(total) {
		t.Errorf("re-watch: index %d epoch %d, want %d and %d", ev.Index, ev.Volume.GetEpoch(), f.AppliedIndex(), total)
	}
	cancel()
	cancel2()
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestFSMWatchRestorePublishes: after Restore every watcher gets its
// volume's state as of the snapshot.
func TestFSMWatchRestorePublishes(t *testing.T) {
	src := openTestFSM(t, "")
	mustApply(t, src, richWorkload()...)
	image := snapshotBytes(t, src)

	dst := openTestFSM(t, "")
	mustApply(t, dst, cmdRegisterServer("s9", "", 0, nil), cmdCreateVolume("vol-stale", "pvc-stale", mib, 1))
	chNew, cancelNew := dst.Watch("vol-1") // only in the snapshot
	defer cancelNew()
	chOld, cancelOld := dst.Watch("vol-stale") // only before the restore
	defer cancelOld()
	checkEvent(t, recvEvent(t, chNew), dst.AppliedIndex(), nil, true)
	checkEvent(t, recvEvent(t, chOld), dst.AppliedIndex(), readVolume(t, dst, "vol-stale"), false)

	if err := dst.Restore(io.NopCloser(bytes.NewReader(image))); err != nil {
		t.Fatal(err)
	}
	checkEvent(t, recvEvent(t, chNew), src.AppliedIndex(), readVolume(t, src, "vol-1"), false)
	checkEvent(t, recvEvent(t, chOld), src.AppliedIndex(), nil, true)

	// Changes after the restore keep coming.
	r := applyCommands(t, dst, cmdDetachVolume("vol-1", ""))[0]
	checkEvent(t, recvEvent(t, chNew), dst.AppliedIndex(), r.msg.(*storpb.Volume), false)
}

// TestFSMWatchOneEventPerChange: Watch promises "one event per committed
// change, in index order". Raft hands the FSM several entries per
// ApplyBatch; two changes to one volume in one batch are two changes.
func TestFSMWatchOneEventPerChange(t *testing.T) {
	f := watchFixture(t)
	ch, cancel := f.Watch("vol-1")
	defer cancel()
	recvEvent(t, ch)
	first := f.AppliedIndex() + 1
	res := applyCommands(t, f,
		cmdAttachVolume("vol-1", "node-1", false),
		cmdAttachVolume("vol-1", "node-2", true),
	)
	for i, r := range res {
		if r.err != nil {
			t.Fatalf("entry %d: %v", i, r.err)
		}
	}
	ev := recvEvent(t, ch)
	if ev.Index != first {
		t.Errorf("first event after the batch: index %d, epoch %d, node %q; want index %d (the attach to node-1, epoch 1)",
			ev.Index, ev.Volume.GetEpoch(), ev.Volume.GetAttachment().GetNodeId(), first)
	}
	checkEvent(t, ev, first, res[0].msg.(*storpb.Volume), false)
	checkEvent(t, recvEvent(t, ch), first+1, res[1].msg.(*storpb.Volume), false)
}
