package raftstore

import (
	"bytes"
	"errors"
	"io"
	"maps"
	"slices"
	"testing"

	bolt "go.etcd.io/bbolt"

	storpb "github.com/stor-io/stor/api/proto"
)

func readNode(t *testing.T, f *FSM, id string) (*storpb.Node, error) {
	t.Helper()
	var n *storpb.Node
	err := f.View(func(r *Reader) error {
		var err error
		n, err = r.Node(id)
		return err
	})
	return n, err
}

// TestFSMRegisterNode: registering is an upsert by id that keeps the first
// registration time, replaces zone and labels and stamps the latest time;
// nodes and servers are separate records.
func TestFSMRegisterNode(t *testing.T) {
	f := openTestFSM(t, "")
	mustApply(t, f, cmdRegisterServer("stor-server-0", "zone-a", gib, nil))

	if _, err := readNode(t, f, "worker-7"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("unregistered node: %v, want ErrNotFound", err)
	}
	if _, err := readNode(t, f, "stor-server-0"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("a server is not a node until it registers as one: %v", err)
	}

	first := mustApply(t, f, cmdRegisterNode("worker-7", "zone-a", map[string]string{"pool": "gpu"}))[0]
	firstAt := stampAt(f.AppliedIndex())
	got := first.msg.(*storpb.Node)
	want := &storpb.Node{Id: "worker-7", Zone: "zone-a", Labels: map[string]string{"pool": "gpu"},
		RegisteredUnixNano: firstAt, LastRegisteredUnixNano: firstAt}
	if got.Id != want.Id || got.Zone != want.Zone || !maps.Equal(got.Labels, want.Labels) ||
		got.RegisteredUnixNano != firstAt || got.LastRegisteredUnixNano != firstAt {
		t.Fatalf("first registration answered %v, want %v", got, want)
	}

	// A restarted plugin registers again, from another zone, without labels.
	mustApply(t, f, cmdRegisterNode("worker-7", "zone-b", nil))
	againAt := stampAt(f.AppliedIndex())
	n, err := readNode(t, f, "worker-7")
	if err != nil {
		t.Fatal(err)
	}
	if n.Zone != "zone-b" || len(n.Labels) != 0 || n.RegisteredUnixNano != firstAt || n.LastRegisteredUnixNano != againAt {
		t.Fatalf("after re-registering: %v; want zone-b, no labels, registered at %d, last at %d", n, firstAt, againAt)
	}

	mustApply(t, f, cmdRegisterNode("stor-server-0", "zone-a", nil), cmdRegisterNode("a-node", "", nil))
	err = f.View(func(r *Reader) error {
		nodes, err := r.Nodes()
		if err != nil {
			return err
		}
		var ids []string
		for _, n := range nodes {
			ids = append(ids, n.Id)
		}
		if want := []string{"a-node", "stor-server-0", "worker-7"}; !slices.Equal(ids, want) {
			t.Errorf("Nodes() = %v, want %v (by id)", ids, want)
		}
		servers, err := r.Servers()
		if err != nil {
			return err
		}
		if len(servers) != 1 || servers[0].Id != "stor-server-0" || servers[0].CapacityBytes != gib {
			t.Errorf("servers changed by node registrations: %v", servers)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestValidID(t *testing.T) {
	for _, tc := range []struct {
		id string
		ok bool
	}{
		{"worker-7", true},
		{"ip-10-0-0-1.ec2.internal", true},
		{"stor-server-0", true},
		{"a", true},
		{"N_1", true},
		{"", false},
		{"-worker", false},
		{".worker", false},
		{"worker 7", false},
		{"worker/7", false},
		{"wörker", false},
		{string(bytes.Repeat([]byte("n"), 63)), true},
		{string(bytes.Repeat([]byte("n"), 64)), false},
	} {
		if got := ValidID(tc.id); got != tc.ok {
			t.Errorf("ValidID(%q) = %v, want %v", tc.id, got, tc.ok)
		}
	}
	// Node ids are Kubernetes node names: up to 253 characters.
	for _, tc := range []struct {
		id string
		ok bool
	}{
		{"worker-7", true},
		{string(bytes.Repeat([]byte("n"), 64)), true},
		{string(bytes.Repeat([]byte("n"), 253)), true},
		{string(bytes.Repeat([]byte("n"), 254)), false},
		{"", false},
		{"worker/7", false},
	} {
		if got := ValidNodeID(tc.id); got != tc.ok {
			t.Errorf("ValidNodeID(%d chars %.10q) = %v, want %v", len(tc.id), tc.id, got, tc.ok)
		}
	}
}

// TestFSMRestoreImageWithoutNodesBucket: a snapshot taken before the nodes
// bucket existed restores, and the restored FSM registers nodes.
func TestFSMRestoreImageWithoutNodesBucket(t *testing.T) {
	src := openTestFSM(t, "")
	mustApply(t, src, cmdInitCluster("c1"), cmdRegisterServer("s1", "a", gib, nil), cmdCreateVolume("vol-1", "pvc-1", mib, 1))
	src.mu.RLock()
	err := src.db.Update(func(tx *bolt.Tx) error { return tx.DeleteBucket(bucketNodes) })
	src.mu.RUnlock()
	if err != nil {
		t.Fatal(err)
	}
	old := dumpState(t, src)
	if _, ok := old[string(bucketNodes)]; ok {
		t.Fatal("fixture: the image still has a nodes bucket")
	}
	image := snapshotBytes(t, src)

	dst := openTestFSM(t, "")
	if err := dst.Restore(io.NopCloser(bytes.NewReader(image))); err != nil {
		t.Fatalf("Restore of an image without a nodes bucket: %v", err)
	}
	got := dumpState(t, dst)
	if nodes, ok := got[string(bucketNodes)]; !ok || len(nodes) != 0 {
		t.Fatalf("restored nodes bucket: present %v, %d keys; want present and empty", ok, len(nodes))
	}
	delete(got, string(bucketNodes))
	requireSameState(t, old, got, "restored old image")
	if v := readVolume(t, dst, "vol-1"); v.Name != "pvc-1" {
		t.Fatalf("restored vol-1: %v", v)
	}
	mustApply(t, dst, cmdRegisterNode("worker-1", "a", nil))
	if _, err := readNode(t, dst, "worker-1"); err != nil {
		t.Fatalf("node registered after the restore: %v", err)
	}
}
