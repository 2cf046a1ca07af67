package csi

// csi-sanity (kubernetes-csi/csi-test/v5 pkg/sanity) against a real
// 3-server in-process cluster (internal/servertest), controller and node
// in one driver, for the mount and the block access type. The node side
// runs with an injected attacher (no kernel NBD here: the VM harness runs
// the real one) and mount-utils' FakeMounter. Ginkgo allows one RunSpecs
// per process, so both access types are registered in one suite.

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	mount "k8s.io/mount-utils"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/servertest"
)

// fakeAttacher stands in for the kernel: a volume "attached" gets a
// device name; its size follows the volume's size in the cluster, as the
// real device does.
type fakeAttacher struct {
	vols storpb.VolumeServiceClient

	mu      sync.Mutex
	devs    map[string]string // volume id -> device; guarded by mu
	next    int
	attachN int
}

func newFakeAttacher(vols storpb.VolumeServiceClient) *fakeAttacher {
	return &fakeAttacher{vols: vols, devs: map[string]string{}}
}

func (f *fakeAttacher) Attach(ctx context.Context, id string, readOnly bool) (string, error) {
	if _, err := f.vols.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}}); err != nil {
		return "", err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if d, ok := f.devs[id]; ok {
		return d, nil
	}
	d := fmt.Sprintf("/dev/fake-nbd%d", f.next)
	f.next++
	f.attachN++
	f.devs[id] = d
	return d, nil
}

func (f *fakeAttacher) Detach(_ context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.devs, id)
	return nil
}

func (f *fakeAttacher) Served(id string) (string, uint64, bool) {
	f.mu.Lock()
	d, ok := f.devs[id]
	f.mu.Unlock()
	if !ok {
		return "", 0, false
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	v, err := f.vols.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
	if err != nil {
		return d, 0, true
	}
	return d, v.GetVolume().GetSizeBytes(), true
}

// Epoch: the fake kernel's engines have none.
func (f *fakeAttacher) Epoch(string) (uint64, bool) { return 0, false }

func (f *fakeAttacher) Close() {}

func (f *fakeAttacher) deviceSize(dev string) (int64, error) {
	f.mu.Lock()
	var id string
	for v, d := range f.devs {
		if d == dev {
			id = v
		}
	}
	f.mu.Unlock()
	if id == "" {
		return 0, fmt.Errorf("%s: no such device", dev)
	}
	_, size, _ := f.Served(id)
	return int64(size), nil
}

// fakeHost is mount-utils' FakeMounter; formatting is mounting, resizing
// is recorded.
func fakeHost(f *fakeAttacher) (*Host, *mount.FakeMounter, *[]string) {
	m := mount.NewFakeMounter(nil)
	var mu sync.Mutex
	var resized []string
	return &Host{
		Mounter:        m,
		FormatAndMount: m.Mount,
		ResizeFS: func(device, path string) error {
			mu.Lock()
			defer mu.Unlock()
			resized = append(resized, device+" "+path)
			return nil
		},
		DeviceSize: f.deviceSize,
	}, m, &resized
}

func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}

// startDriver runs a driver in mode all against the cluster on a unix
// socket in dir, as the node of the cluster's first server, and returns
// its endpoint.
func startDriver(t testing.TB, c *servertest.Cluster, dir string, att Attacher, host *Host) (string, *Driver) {
	t.Helper()
	return startDriverAs(t, c, dir, c.Nodes[0].ID, "", att, host)
}

// startDriverAs is startDriver with the node plugin's node id and zone.
func startDriverAs(t testing.TB, c *servertest.Cluster, dir, nodeID, zone string, att Attacher, host *Host) (string, *Driver) {
	t.Helper()
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr)
	}
	cl, err := client.Dial(addrs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	sock := filepath.Join(dir, "csi.sock")
	d, err := New(Config{
		Mode: ModeAll, Endpoint: "unix://" + sock, NodeID: nodeID, Zone: zone,
		StateDir: filepath.Join(dir, "state"),
		Cluster:  Cluster{Cluster: cl.Cluster, Volumes: cl.Volumes, Snapshots: cl.Snapshots},
		Attacher: att, Host: host, Logger: testLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("driver Run: %v", err)
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the driver did not listen within 10s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return "unix://" + sock, d
}

const (
	sanityVolumeSize = 10 << 30 // a multiple of BlockSize: no rounding
	sanityExpandSize = 11 << 30
)

func sanityConfig(endpoint, dir, accessType string) *sanity.TestConfig {
	cfg := sanity.NewTestConfig()
	cfg.Address = endpoint
	cfg.TargetPath = filepath.Join(dir, accessType+"-target")
	cfg.StagingPath = filepath.Join(dir, accessType+"-staging")
	cfg.TestVolumeSize = sanityVolumeSize
	cfg.TestVolumeExpandSize = sanityExpandSize
	cfg.TestVolumeAccessType = accessType
	cfg.IdempotentCount = 3
	cfg.TestNodeVolumeAttachLimit = true
	return &cfg
}

func TestSanity(t *testing.T) {
	if testing.Short() {
		t.Skip("csi-sanity starts a 3-server cluster")
	}
	c := servertest.NewCluster(t, servertest.Options{Servers: 3})
	dir := t.TempDir()
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr)
	}
	cl, err := client.Dial(addrs)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	att := newFakeAttacher(cl.Volumes)
	host, _, _ := fakeHost(att)
	endpoint, _ := startDriver(t, c, dir, att, host)

	mountCfg := sanityConfig(endpoint, dir, "mount")
	blockCfg := sanityConfig(endpoint, dir, "block")
	var mountCtx, blockCtx *sanity.TestContext
	Describe("access type mount", func() { mountCtx = sanity.GinkgoTest(mountCfg) })
	Describe("access type block", func() { blockCtx = sanity.GinkgoTest(blockCfg) })
	RegisterFailHandler(Fail)
	suite, reporter := GinkgoConfiguration()
	suite.Timeout = 20 * time.Minute
	reporter.Verbose = testing.Verbose()
	RunSpecs(t, "stor CSI sanity", suite, reporter)
	if mountCtx != nil {
		mountCtx.Finalize()
	}
	if blockCtx != nil {
		blockCtx.Finalize()
	}
}
