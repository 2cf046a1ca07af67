package csi

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/attach"
	"github.com/stor-io/stor/nbd/kernel"
)

// Start, in node mode, prepares the process for serving the kernel's
// writeback (PR_SET_IO_FLUSHER, oom_score_adj) before it recovers, and a
// refusal does not stop it.
func TestNodeStartPreparesTheProcess(t *testing.T) {
	var flusher int
	var adj []int
	proc := attach.Process{
		SetIOFlusher:   func() error { flusher++; return unix.EPERM },
		SetOOMScoreAdj: func(a int) error { adj = append(adj, a); return nil },
	}
	d, err := New(Config{
		Mode: ModeNode, NodeID: "worker-1", StateDir: t.TempDir(), Process: &proc,
		Cluster:  Cluster{Cluster: &fakeRegistry{}, Volumes: storpb.NewVolumeServiceClient(nil), Snapshots: storpb.NewSnapshotServiceClient(nil)},
		Attacher: newFakeAttacher(nil), Logger: testLogger(t), CallTimeout: time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.Start(ctx); err != nil {
		t.Fatalf("Start with PR_SET_IO_FLUSHER refused: %v, want it to go on", err)
	}
	if flusher != 1 || len(adj) != 1 || adj[0] != attach.OOMScoreAdj {
		t.Fatalf("Start set PR_SET_IO_FLUSHER %d times and oom_score_adj %v; want once each, %d", flusher, adj, attach.OOMScoreAdj)
	}
	if err := d.Ready(ctx); err != nil {
		t.Fatalf("not ready after Start: %v", err)
	}
}

// dialOnlyKernel is a kernel whose nbd netlink family answers Dial with
// err (nil: a connection that counts its Close) and nothing else.
type dialOnlyKernel struct {
	err    error
	dials  int
	closes int
}

func (k *dialOnlyKernel) kernel() *attach.Kernel {
	return &attach.Kernel{Dial: func() (attach.KernelConn, error) {
		k.dials++
		if k.err != nil {
			return nil, k.err
		}
		return closeCounter{k}, nil
	}}
}

type closeCounter struct{ k *dialOnlyKernel }

func (closeCounter) Connect(context.Context, kernel.Options) (int, error) { return 0, nil }
func (closeCounter) Reconfigure(context.Context, int, kernel.Reconfig) error {
	return nil
}
func (closeCounter) Disconnect(context.Context, int) error { return nil }
func (closeCounter) Status(context.Context, int) (kernel.Device, error) {
	return kernel.Device{}, nil
}
func (c closeCounter) Close() error { c.k.closes++; return nil }

// The node plugin with the kernel's attacher checks at New that it
// reaches the nbd netlink family: a kernel whose family is hidden from the
// plugin's network namespace (before Linux 6.3, a pod without hostNetwork)
// fails New with an error that says so and what to do, before the plugin
// registers or serves anything; so does a kernel without the module. A
// reachable family is dialled once and closed.
func TestNodeChecksTheKernelAtStart(t *testing.T) {
	hidden := fmt.Errorf("%w; this is Linux 6.1.0-56-amd64: run in the host's network namespace", kernel.ErrNetNamespace)
	for _, tc := range []struct {
		name string
		err  error
		want []string // in New's error; none: New succeeds
	}{
		{"family reachable", nil, nil},
		{"family hidden by the network namespace", hidden, []string{
			"not visible in this network namespace", "not netns-aware", "Linux 6.1.0-56-amd64", "run the node plugin with hostNetwork: true",
		}},
		{"no nbd module", kernel.ErrUnsupported, []string{"cannot attach devices", "modprobe nbd"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, mode := range []Mode{ModeNode, ModeAll} {
				k := &dialOnlyKernel{err: tc.err}
				d, err := New(Config{
					Mode: mode, NodeID: "worker-1", StateDir: t.TempDir(), Process: &attach.Process{},
					Cluster: Cluster{Cluster: &fakeRegistry{}, Volumes: storpb.NewVolumeServiceClient(nil), Snapshots: storpb.NewSnapshotServiceClient(nil)},
					Kernel:  k.kernel(), Logger: testLogger(t), CallTimeout: time.Second,
				})
				if k.dials != 1 {
					t.Fatalf("%s: New dialled the nbd family %d times, want once", mode, k.dials)
				}
				if tc.want == nil {
					if err != nil {
						t.Fatalf("%s: New with a reachable nbd family: %v", mode, err)
					}
					d.Close()
					if k.closes != 1 {
						t.Fatalf("%s: the check's connection was closed %d times, want once", mode, k.closes)
					}
					continue
				}
				if err == nil {
					d.Close()
					t.Fatalf("%s: New succeeded with the kernel answering %v; want it to fail at start", mode, tc.err)
				}
				if !errors.Is(err, tc.err) {
					t.Fatalf("%s: New: %v, want it to wrap %v", mode, err, tc.err)
				}
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Fatalf("%s: New: %v; want it to say %q", mode, err, w)
					}
				}
				t.Logf("%s: %v", mode, err)
			}
		})
	}
}
