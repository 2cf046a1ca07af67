package raftstore

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// Events: what the cluster did and why (storpb.Event), recorded by the
// state machine itself. Every write of a volume or server record compares
// it with the record it replaces (writer.put) and records each change an
// operator cares about: replica added, removed, faulty (with the reason
// the command gave, clipped to 512 bytes), rebuild started and finished;
// attach, detach, takeover; expansion, deletion; snapshot requested,
// ready, failed, a copy lost, deleted; server registered, down, up,
// cordoned, draining, removed. The same for snapshot records. So the events are in one place, derived from the
// state they describe, on every server alike, with the command's time
// (command.At). The newest MaxEvents are kept, in bucketEvents under
// their sequence number (big-endian).

// MaxEvents is how many events the cluster keeps.
const MaxEvents = 10000

var (
	bucketEvents = []byte("events")
	keyEventSeq  = []byte("event_seq")
)

// event appends one event.
func (w *writer) event(e *storpb.Event) {
	seq := uint64(1)
	if b := w.tx.Bucket(bucketMeta).Get(keyEventSeq); len(b) == 8 {
		seq = binary.BigEndian.Uint64(b) + 1
	}
	e.Seq, e.AtUnixNano = seq, w.at
	w.putRaw(bucketMeta, string(keyEventSeq), string(binary.BigEndian.AppendUint64(nil, seq)))
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(e)
	if err != nil {
		panic(fmt.Sprintf("raftstore: marshal event: %v", err))
	}
	w.must(w.tx.Bucket(bucketEvents).Put(binary.BigEndian.AppendUint64(nil, seq), b))
	if seq > MaxEvents {
		w.must(w.tx.Bucket(bucketEvents).Delete(binary.BigEndian.AppendUint64(nil, seq-MaxEvents)))
	}
}

// recordChange records the events of a write of m under key in bucket
// (called by put and del, before the write; m nil for a deletion).
func (w *writer) recordChange(bucket []byte, key string, m proto.Message) {
	switch {
	case bytes.Equal(bucket, bucketVolumes):
		old, err := w.Volume(key)
		if err != nil {
			old = nil
		}
		v, _ := m.(*storpb.Volume)
		w.volumeEvents(old, v)
	case bytes.Equal(bucket, bucketServers):
		old, err := w.Server(key)
		if err != nil {
			old = nil
		}
		s, _ := m.(*storpb.Server)
		w.serverEvents(old, s)
	case bytes.Equal(bucket, bucketSnapshots):
		old, err := w.Snapshot(key)
		if err != nil {
			old = nil
		}
		s, _ := m.(*storpb.Snapshot)
		w.snapshotEvents(old, s)
	}
}

// maxEventReason bounds the part of an event's message a command's
// reason (a client's text) may take.
const maxEventReason = 512

// clip cuts s to at most n bytes of valid UTF-8, saying so.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n], "") + "..."
}

func (w *writer) snapshotEvents(old, s *storpb.Snapshot) {
	cur := s
	if cur == nil {
		cur = old
	}
	if s != nil && s.Failed && (old == nil || !old.Failed) {
		// Its clones being filled cannot be: said on each once the
		// command is done (recordCloneFailures).
		if w.failedSnapshots == nil {
			w.failedSnapshots = map[string]*storpb.Snapshot{}
		}
		w.failedSnapshots[s.Id] = proto.Clone(s).(*storpb.Snapshot)
	}
	if cur == nil || cur.ImplicitForVolumeId != "" {
		return // a clone's own snapshot: the clone's events tell
	}
	e := func(reason, format string, args ...any) {
		ev := &storpb.Event{VolumeId: cur.VolumeId, Reason: reason, Message: fmt.Sprintf(format, args...)}
		if v, err := w.Volume(cur.VolumeId); err == nil {
			ev.VolumeName = v.Name
		}
		w.event(ev)
	}
	switch {
	case s == nil:
		e("SnapshotDeleted", "snapshot %s deleted", old.Name)
		return
	case old == nil:
		e("SnapshotRequested", "snapshot %s requested", s.Name)
		old = &storpb.Snapshot{Replicas: s.Replicas}
	}
	if s.ReadyToUse && !old.ReadyToUse {
		e("SnapshotReady", "snapshot %s ready", s.Name)
	}
	if s.Failed && !old.Failed {
		e("SnapshotFailed", "snapshot %s failed: %s", s.Name, clip(s.StatusMessage, maxEventReason))
	}
	for _, r := range s.Replicas {
		i := slices.IndexFunc(old.Replicas, func(x *storpb.SnapshotReplica) bool { return x.ReplicaId == r.ReplicaId })
		if r.State == storpb.SnapshotReplicaState_SNAPSHOT_REPLICA_STATE_LOST && (i < 0 || old.Replicas[i].State != r.State) {
			e("SnapshotCopyLost", "snapshot %s lost its copy on replica %s (server %s): %s", s.Name, r.ReplicaId, r.ServerId, clip(r.Reason, maxEventReason))
		}
	}
}

func (w *writer) volumeEvents(old, v *storpb.Volume) {
	ev := func(rep *storpb.Replica, reason, format string, args ...any) {
		e := &storpb.Event{Reason: reason, Message: fmt.Sprintf(format, args...)}
		if cur := v; cur != nil {
			e.VolumeId, e.VolumeName = cur.Id, cur.Name
		} else {
			e.VolumeId, e.VolumeName = old.Id, old.Name
		}
		if rep != nil {
			e.ReplicaId, e.ServerId = rep.Id, rep.ServerId
		}
		w.event(e)
	}
	switch {
	case old == nil && v == nil:
		return
	case v == nil && old.State == storpb.VolumeState_VOLUME_STATE_DELETED:
		ev(nil, "VolumeRemoved", "volume %s removed with its last snapshot", old.Name)
		return
	case v == nil:
		ev(nil, "VolumeDeleted", "volume %s deleted", old.Name)
		return
	case old == nil:
		var on []string
		for _, r := range v.Replicas {
			on = append(on, r.ServerId)
		}
		ev(nil, "VolumeCreated", "volume %s created: %d bytes, replicas on %s", v.Name, v.SizeBytes, strings.Join(on, ", "))
		old = &storpb.Volume{Id: v.Id, Name: v.Name, SizeBytes: v.SizeBytes, Replicas: v.Replicas}
	}
	if v.SizeBytes != old.SizeBytes {
		ev(nil, "VolumeExpanded", "volume %s expanded from %d to %d bytes", v.Name, old.SizeBytes, v.SizeBytes)
	}
	if v.State != old.State && v.State == storpb.VolumeState_VOLUME_STATE_DELETED {
		ev(nil, "VolumeDeleted", "volume %s deleted; kept until its last snapshot is deleted", v.Name)
	}
	was, now := old.GetAttachment().GetNodeId(), v.GetAttachment().GetNodeId()
	switch {
	case was == "" && now != "":
		ev(nil, "Attached", "attached to node %s at epoch %d", now, v.Epoch)
	case was != "" && now == "":
		ev(nil, "Detached", "detached from node %s", was)
	case was != now:
		ev(nil, "TakenOver", "taken over by node %s from node %s at epoch %d", now, was, v.Epoch)
	case now != "" && v.Epoch != old.Epoch:
		ev(nil, "Attached", "attached to node %s again at epoch %d", now, v.Epoch)
	}
	for _, r := range old.Replicas {
		if !slices.ContainsFunc(v.Replicas, func(x *storpb.Replica) bool { return x.Id == r.Id }) {
			how := "removed"
			if w.op == opRepairReplica {
				how = "replaced by the leader's repair"
			}
			ev(r, "ReplicaRemoved", "replica %s on server %s %s (it was %s)", r.Id, r.ServerId, how, stateWord(r.State))
		}
	}
	for _, r := range v.Replicas {
		i := slices.IndexFunc(old.Replicas, func(x *storpb.Replica) bool { return x.Id == r.Id })
		if i < 0 {
			ev(r, "ReplicaAdded", "replica %s added on server %s (%s)", r.Id, r.ServerId, rebuildWord(r))
			continue
		}
		o := old.Replicas[i]
		if o.State == r.State {
			continue
		}
		switch r.State {
		case storpb.ReplicaState_REPLICA_STATE_FAULTY:
			why := clip(w.reason, maxEventReason)
			if why == "" {
				why = "no reason given"
			}
			ev(r, "ReplicaFaulty", "replica %s on server %s faulty: %s", r.Id, r.ServerId, why)
		case storpb.ReplicaState_REPLICA_STATE_REBUILDING:
			ev(r, "RebuildStarted", "replica %s on server %s rebuilding (%s)", r.Id, r.ServerId, rebuildWord(r))
		case storpb.ReplicaState_REPLICA_STATE_HEALTHY:
			if o.State == storpb.ReplicaState_REPLICA_STATE_REBUILDING {
				ev(r, "RebuildFinished", "replica %s on server %s healthy: rebuild finished", r.Id, r.ServerId)
			} else {
				ev(r, "ReplicaHealthy", "replica %s on server %s healthy", r.Id, r.ServerId)
			}
		}
	}
}

func (w *writer) serverEvents(old, s *storpb.Server) {
	ev := func(id, reason, format string, args ...any) {
		w.event(&storpb.Event{ServerId: id, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	switch {
	case old == nil && s == nil:
		return
	case s == nil:
		ev(old.Id, "ServerRemoved", "server %s removed from the cluster", old.Id)
		return
	case old == nil:
		ev(s.Id, "ServerRegistered", "server %s registered (%s)", s.Id, s.Address)
		return
	}
	if s.State != old.State {
		switch s.State {
		case storpb.ServerState_SERVER_STATE_DOWN:
			ev(s.Id, "ServerDown", "server %s down: no heartbeat", s.Id)
		case storpb.ServerState_SERVER_STATE_UP:
			ev(s.Id, "ServerUp", "server %s up", s.Id)
		}
	}
	switch {
	case s.Draining && !old.Draining:
		ev(s.Id, "ServerDraining", "server %s cordoned and draining: its replicas move elsewhere", s.Id)
	case s.Cordoned && !old.Cordoned:
		ev(s.Id, "ServerCordoned", "server %s cordoned: no new replica is placed on it", s.Id)
	case !s.Cordoned && old.Cordoned:
		ev(s.Id, "ServerUncordoned", "server %s uncordoned", s.Id)
	case !s.Draining && old.Draining:
		ev(s.Id, "ServerDrainStopped", "server %s no longer draining; still cordoned", s.Id)
	}
}

func stateWord(s storpb.ReplicaState) string {
	return strings.ToLower(strings.TrimPrefix(s.String(), "REPLICA_STATE_"))
}

func rebuildWord(r *storpb.Replica) string {
	switch {
	case r.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING:
		return stateWord(r.State)
	case r.RebuildFromGeneration > 0:
		return fmt.Sprintf("a delta rebuild from generation %d", r.RebuildFromGeneration)
	}
	return "a full rebuild"
}

// Events returns up to limit events with seq above after, the oldest
// first; only volumeID's when it is not empty.
func (r *Reader) Events(volumeID string, after uint64, limit int) ([]*storpb.Event, error) {
	var out []*storpb.Event
	b := r.tx.Bucket(bucketEvents)
	if b == nil {
		return nil, nil
	}
	c := b.Cursor()
	for k, v := c.Seek(binary.BigEndian.AppendUint64(nil, after+1)); k != nil && len(out) < limit; k, v = c.Next() {
		e := &storpb.Event{}
		if err := proto.Unmarshal(v, e); err != nil {
			return nil, fmt.Errorf("%w: event %x: %v", ErrCorrupt, k, err)
		}
		if volumeID == "" || e.VolumeId == volumeID {
			out = append(out, e)
		}
	}
	return out, nil
}
