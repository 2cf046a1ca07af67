package raftstore

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
)

// TestFSMLabelCaps: a volume's parameters and a server's or node's labels
// beyond the caps (count, key length, value length, total bytes, a key
// with a control character) are ErrInvalidArgument and leave no trace;
// maps at the caps are accepted.
func TestFSMLabelCaps(t *testing.T) {
	many := func(n, valueLen int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprintf("k%03d", i)] = strings.Repeat("v", valueLen)
		}
		return m
	}
	cases := []struct {
		name string
		m    map[string]string
		ok   bool
	}{
		{"at the count cap", many(MaxLabels, 1), true},
		{"one over the count cap", many(MaxLabels+1, 1), false},
		{"a value at the cap", map[string]string{"k": strings.Repeat("v", MaxLabelValueLen)}, true},
		{"a value over the cap", map[string]string{"k": strings.Repeat("v", MaxLabelValueLen+1)}, false},
		{"a key at the cap", map[string]string{strings.Repeat("k", MaxLabelKeyLen): "v"}, true},
		{"a key over the cap", map[string]string{strings.Repeat("k", MaxLabelKeyLen+1): "v"}, false},
		{"an empty key", map[string]string{"": "v"}, false},
		{"a key with an escape sequence", map[string]string{"evil\x1b[2J": "v"}, false},
		{"a key with a newline", map[string]string{"a\nb": "v"}, false},
		{"over the total", many(5, MaxLabelValueLen), false},
	}
	for _, tc := range cases {
		for _, kind := range []string{"volume parameters", "server labels", "node labels"} {
			t.Run(tc.name+"/"+kind, func(t *testing.T) {
				f := openTestFSM(t, "")
				mustApply(t, f, cmdRegisterServer("s1", "a", 0, nil))
				var cmd command
				switch kind {
				case "volume parameters":
					cmd = cmdCreateVolumeReq("vol-1", &storpb.CreateVolumeRequest{Name: "pvc-1", SizeBytes: mib, ReplicaCount: 1, Parameters: tc.m})
				case "server labels":
					cmd = cmdRegisterServer("s2", "a", 0, tc.m)
				default:
					cmd = cmdRegisterNode("n1", "a", tc.m)
				}
				before := dumpState(t, f)
				r := applyCommands(t, f, cmd)[0]
				switch {
				case tc.ok && r.err != nil:
					t.Fatalf("refused: %v", r.err)
				case !tc.ok && !errors.Is(r.err, ErrInvalidArgument):
					t.Fatalf("got %v, want ErrInvalidArgument", r.err)
				case !tc.ok:
					if strings.ContainsAny(r.err.Error(), "\x1b\n") || len(r.err.Error()) > 400 {
						t.Errorf("the error repeats the input raw or at length: %q", r.err)
					}
					requireSameState(t, withoutApplied(before), withoutApplied(dumpState(t, f)), "state after a refused command")
				}
			})
		}
	}
}

// TestFSMSnapshotsPerVolumeCap: a volume takes MaxSnapshotsPerVolume
// snapshots; one more, named or the implicit one of a clone, is
// ErrResourceExhausted; deleting one makes room again.
func TestFSMSnapshotsPerVolumeCap(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdRegisterServer("s1", "a", 0, nil), cmdCreateVolume("vol-1", "pvc-1", mib, 1))
	for i := range MaxSnapshotsPerVolume {
		mustApply(t, f, cmdCreateSnapshot(fmt.Sprintf("snap-%d", i), "vol-1", fmt.Sprintf("s-%d", i)))
	}
	if r := applyCommands(t, f, cmdCreateSnapshot("snap-x", "vol-1", "s-x"))[0]; !errors.Is(r.err, ErrResourceExhausted) {
		t.Fatalf("snapshot %d: %v, want ErrResourceExhausted", MaxSnapshotsPerVolume+1, r.err)
	}
	clone := cmdCreateVolumeReq("vol-2", &storpb.CreateVolumeRequest{Name: "pvc-2", SizeBytes: mib, ReplicaCount: 1,
		ContentSource: &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: "vol-1"}}})
	if r := applyCommands(t, f, clone)[0]; !errors.Is(r.err, ErrResourceExhausted) {
		t.Fatalf("a clone needing one more snapshot of the volume: %v, want ErrResourceExhausted", r.err)
	}
	// Snapshots of other volumes do not count.
	mustApply(t, f, cmdCreateVolume("vol-3", "pvc-3", mib, 1), cmdCreateSnapshot("snap-o", "vol-3", "s-o"))
	mustApply(t, f, cmdDeleteSnapshot("snap-0"))
	mustApply(t, f, cmdCreateSnapshot("snap-x", "vol-1", "s-x"))
}

// TestRefsOverTheNameCap: a volume or snapshot reference longer than any
// name or id can be is ErrInvalidArgument with a short error, not a
// NotFound that repeats the whole reference (a 100 KiB id came back in
// the error).
func TestRefsOverTheNameCap(t *testing.T) {
	f := openTestFSM(t, "")
	long := strings.Repeat("x", 100<<10)
	if err := f.View(func(r *Reader) error {
		for _, err := range []error{
			func() error { _, err := r.VolumeByRef(&storpb.VolumeRef{Id: long}); return err }(),
			func() error { _, err := r.VolumeByRef(&storpb.VolumeRef{Name: long}); return err }(),
			func() error { _, err := r.SnapshotByRef(&storpb.SnapshotRef{Id: long}); return err }(),
			func() error { _, err := r.SnapshotByRef(&storpb.SnapshotRef{Name: long}); return err }(),
		} {
			if !errors.Is(err, ErrInvalidArgument) || len(err.Error()) > 400 {
				t.Errorf("a 100 KiB reference: %.200v (%d bytes), want a short ErrInvalidArgument", err, len(fmt.Sprint(err)))
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
