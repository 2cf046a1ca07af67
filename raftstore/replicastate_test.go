package raftstore

import (
	"errors"
	"fmt"
	"testing"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

const (
	healthy    = storpb.ReplicaState_REPLICA_STATE_HEALTHY
	rebuilding = storpb.ReplicaState_REPLICA_STATE_REBUILDING
	faulty     = storpb.ReplicaState_REPLICA_STATE_FAULTY
)

// replicaStep is one command against volume "vol" of replicaFixture, built
// from the volume as it is committed before the step.
type replicaStep struct {
	name    string
	cmd     func(v *storpb.Volume) command
	wantErr error // nil: must be applied
}

func stepState(id string, st storpb.ReplicaState) replicaStep {
	return replicaStep{name: fmt.Sprintf("%s %v", id, st), cmd: func(v *storpb.Volume) command {
		return cmdSetReplicaState(v.Id, id, st, v.Epoch, 0)
	}}
}

func stepFault(id string) replicaStep   { return stepState(id, faulty) }
func stepRebuild(id string) replicaStep { return stepState(id, rebuilding) }

// stepRebuilt completes the rebuild that started at the replica's current
// generation.
func stepRebuilt(id string) replicaStep {
	return replicaStep{name: id + " rebuilt", cmd: func(v *storpb.Volume) command {
		return cmdSetReplicaState(v.Id, id, healthy, v.Epoch, findReplica(v, id).GetGeneration())
	}}
}

// stepProgress reports progress with a resume offset for the rebuild
// attempt at generation attempt (0: the replica's current generation).
func stepProgress(id string, attempt, resume uint64) replicaStep {
	return replicaStep{name: fmt.Sprintf("%s progress (attempt %d, resume %d)", id, attempt, resume), cmd: func(v *storpb.Volume) command {
		gen := attempt
		if gen == 0 {
			gen = findReplica(v, id).GetGeneration()
		}
		return progressCmd(v, id, gen, resume)
	}}
}

func progressCmd(v *storpb.Volume, id string, attempt, resume uint64) command {
	return command{Op: opSetReplicaState, Body: &storpb.SetReplicaStateRequest{
		VolumeId: v.Id, ReplicaId: id, State: rebuilding, Epoch: v.Epoch, Generation: attempt,
		RebuildDoneBytes: resume, RebuildTotalBytes: 8 * mib, RebuildResumeOffset: resume,
	}}
}

func stepReplace(old, newID string) replicaStep {
	return replicaStep{name: "replace " + old + " by " + newID, cmd: func(v *storpb.Volume) command {
		return cmdReplaceReplica(v.Id, old, "", newID, false)
	}}
}

func refused(s replicaStep, err error) replicaStep {
	s.name += " (refused)"
	s.wantErr = err
	return s
}

// replicaFixture is a volume "vol" with 3 healthy replicas (vol-r1..r3)
// on 4 servers, attached at epoch 1, generation 1.
func replicaFixture(t testing.TB) *FSM {
	f := openTestFSM(t, "")
	mustApply(t, f,
		cmdInitCluster("c1"),
		cmdRegisterServer("s1", "a", 100*gib, nil),
		cmdRegisterServer("s2", "b", 100*gib, nil),
		cmdRegisterServer("s3", "c", 100*gib, nil),
		cmdRegisterServer("s4", "d", 100*gib, nil),
		cmdCreateVolume("vol", "pvc", gib, 3),
		cmdAttachVolume("vol", "node-1", false),
	)
	return f
}

// TestReplicaRebuildStartingPoint: the starting point of a replica's
// rebuild (rebuild_from_generation: where it stopped being healthy, or 0
// for full) survives every failed rebuild, and a full rebuild's checkpoint
// survives only while the replica stays in the write set. Defects A and B
// of issue 13: every transition used to reset both, and a rebuild of a
// faulty replica started from the generation of its latest fault.
func TestReplicaRebuildStartingPoint(t *testing.T) {
	type want struct {
		state      storpb.ReplicaState
		from       uint64
		resume     uint64
		generation uint64
	}
	cases := []struct {
		name    string
		replica string
		steps   []replicaStep
		want    want
	}{
		{
			name: "a first fault records its generation", replica: "vol-r3",
			steps: []replicaStep{stepFault("vol-r3")},
			want:  want{state: faulty, from: 2, generation: 2},
		},
		{
			name: "A: a delta rebuild that fails is retried from the first fault", replica: "vol-r3",
			steps: []replicaStep{stepFault("vol-r3"), stepRebuild("vol-r3"), stepFault("vol-r3"), stepRebuild("vol-r3")},
			want:  want{state: rebuilding, from: 2, generation: 5},
		},
		{
			name: "A: however many times it fails", replica: "vol-r3",
			steps: []replicaStep{
				stepFault("vol-r3"), stepRebuild("vol-r3"), stepFault("vol-r3"), stepRebuild("vol-r3"),
				stepFault("vol-r3"), stepFault("vol-r3"), stepRebuild("vol-r3"), stepFault("vol-r3"),
			},
			want: want{state: faulty, from: 2, generation: 8},
		},
		{
			name: "A: a source's fault leaves the target's starting point", replica: "vol-r3",
			steps: []replicaStep{stepFault("vol-r3"), stepRebuild("vol-r3"), stepFault("vol-r1")},
			want:  want{state: rebuilding, from: 2, generation: 3},
		},
		{
			name: "a replica healthy again starts from its next fault", replica: "vol-r3",
			steps: []replicaStep{stepFault("vol-r3"), stepRebuild("vol-r3"), stepRebuilt("vol-r3"), stepFault("vol-r2"), stepFault("vol-r3")},
			want:  want{state: faulty, from: 6, generation: 6},
		},
		{
			name: "B: a new replica whose full rebuild fails is retried in full", replica: "vol-r4",
			steps: []replicaStep{stepReplace("vol-r3", "vol-r4"), stepFault("vol-r4"), stepRebuild("vol-r4")},
			want:  want{state: rebuilding, from: 0, generation: 4},
		},
		{
			name: "B: a healthy replica's fault while a new one is full leaves the new one full", replica: "vol-r4",
			steps: []replicaStep{stepReplace("vol-r3", "vol-r4"), stepFault("vol-r4"), stepFault("vol-r1"), stepRebuild("vol-r4"), stepFault("vol-r4")},
			want:  want{state: faulty, from: 0, generation: 6},
		},
		{
			name: "a checkpoint holds while the replica stays rebuilding", replica: "vol-r4",
			steps: []replicaStep{stepReplace("vol-r3", "vol-r4"), stepProgress("vol-r4", 0, 4*mib), stepProgress("vol-r4", 0, 2*mib), stepFault("vol-r1")},
			want:  want{state: rebuilding, from: 0, resume: 4 * mib, generation: 2},
		},
		{
			name: "a fault drops the checkpoint: the replica missed writes below it", replica: "vol-r4",
			steps: []replicaStep{stepReplace("vol-r3", "vol-r4"), stepProgress("vol-r4", 0, 4*mib), stepFault("vol-r4"), stepRebuild("vol-r4")},
			want:  want{state: rebuilding, from: 0, resume: 0, generation: 4},
		},
		{
			name: "a late checkpoint of a failed attempt is not recorded for the next", replica: "vol-r4",
			steps: []replicaStep{
				stepReplace("vol-r3", "vol-r4"), stepFault("vol-r4"), stepRebuild("vol-r4"),
				refused(stepProgress("vol-r4", 2, 4*mib), ErrFailedPrecondition),
			},
			want: want{state: rebuilding, from: 0, resume: 0, generation: 4},
		},
		{
			name: "a late progress report does not start a rebuild of a faulty replica", replica: "vol-r4",
			steps: []replicaStep{
				stepReplace("vol-r3", "vol-r4"), stepFault("vol-r4"),
				refused(stepProgress("vol-r4", 2, 4*mib), ErrFailedPrecondition),
			},
			want: want{state: faulty, from: 0, resume: 0, generation: 3},
		},
		{
			name: "a superseded attempt cannot mark the replica healthy", replica: "vol-r3",
			steps: []replicaStep{
				stepFault("vol-r3"), stepRebuild("vol-r3"), stepFault("vol-r3"), stepRebuild("vol-r3"),
				refused(replicaStep{name: "vol-r3 rebuilt by the first attempt", cmd: func(v *storpb.Volume) command {
					return cmdSetReplicaState(v.Id, "vol-r3", healthy, v.Epoch, 3)
				}}, ErrFailedPrecondition),
			},
			want: want{state: rebuilding, from: 2, generation: 5},
		},
		{
			name: "the last healthy replica is never faulty", replica: "vol-r1",
			steps: []replicaStep{stepFault("vol-r3"), stepFault("vol-r2"), refused(stepFault("vol-r1"), ErrFailedPrecondition)},
			want:  want{state: healthy, from: 0, generation: 1},
		},
		{
			name: "a replica whose server is removed is full", replica: "vol-r3",
			steps: []replicaStep{stepFault("vol-r3"), {name: "remove its server", cmd: func(v *storpb.Volume) command {
				return cmdRemoveServer(findReplica(v, "vol-r3").ServerId)
			}}},
			want: want{state: faulty, from: 0, generation: 3},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := replicaFixture(t)
			for _, s := range tc.steps {
				v := readVolume(t, f, "vol")
				r := applyCommands(t, f, s.cmd(v))[0]
				if !errors.Is(r.err, s.wantErr) || (s.wantErr == nil && r.err != nil) {
					t.Fatalf("step %q: %v, want %v", s.name, r.err, s.wantErr)
				}
				if s.wantErr != nil {
					if after := readVolume(t, f, "vol"); !proto.Equal(after, v) {
						t.Fatalf("step %q was refused but changed the volume:\n\tbefore %v\n\tafter  %v", s.name, v, after)
					}
				}
			}
			v := readVolume(t, f, "vol")
			r := findReplica(v, tc.replica)
			if r == nil {
				t.Fatalf("no replica %s in %v", tc.replica, v)
			}
			got := want{state: r.State, from: r.RebuildFromGeneration, resume: r.RebuildResumeOffset, generation: r.Generation}
			if got != tc.want {
				t.Fatalf("replica %s: state %v, rebuild from generation %d, resume offset %d, generation %d;\n\twant state %v, from %d, resume %d, generation %d",
					tc.replica, got.state, got.from, got.resume, got.generation, tc.want.state, tc.want.from, tc.want.resume, tc.want.generation)
			}
			if r.State != rebuilding && (r.RebuildDoneBytes != 0 || r.RebuildTotalBytes != 0) {
				t.Fatalf("replica %s is %v with rebuild progress %d/%d", r.Id, r.State, r.RebuildDoneBytes, r.RebuildTotalBytes)
			}
		})
	}
}
