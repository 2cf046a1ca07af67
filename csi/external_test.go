package csi

// Tests against a real stor-csi process, a real cluster and the real
// kernel: the VM harness runs them (internal/vmtest, TestVMCSI*) in a
// guest with the nbd module, a 3-server cluster and /bin/stor-csi. They
// skip unless $STOR_CSI_EXTERNAL is set:
//
//	STOR_CSI_EXTERNAL=1           run them
//	STOR_CSI_BIN=/bin/stor-csi    the plugin binary (started and restarted here)
//	STOR_SERVER=a:7400,b:7410,... the cluster
//	STOR_CSI_NODE_ID=s1           the node id (a stor-server id)
//	STOR_CSI_DIR=/tmp/csi         socket, state dir, mount points
//	STOR_CSI_MAX_VOLUMES=4        the plugin's --max-volumes (csi-sanity's
//	                              attach-limit test creates that many + 1)
//	STOR_CSI_TLS_DIR=/tmp/stor/tls certificates made by stor-ctl certs local
//	                              (--node <node id>): the controller and the
//	                              node plugin then run as two processes with
//	                              TLS, each with its role's certificate;
//	                              unset: one process, mode all, plaintext

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	"github.com/stor-io/stor/internal/pki"
)

type external struct {
	t                     *testing.T
	bin, servers, node    string
	dir, endpoint, stateD string
	// ctrlEndpoint is the controller's socket: endpoint (one process,
	// mode all) without TLS; with TLS the controller and the node plugin
	// are two processes, as in a deployment, each with its certificate.
	ctrlEndpoint string
	plugins      []*plugin

	conn *grpc.ClientConn
	ctrl csipb.ControllerClient
	nd   csipb.NodeClient
	id   csipb.IdentityClient
}

// plugin is one stor-csi process.
type plugin struct {
	mode, endpoint, log string
	health              string // --health-listen
	tls                 pki.Files

	cmd  *exec.Cmd
	logf *os.File
}

func needExternal(t *testing.T) *external {
	t.Helper()
	if os.Getenv("STOR_CSI_EXTERNAL") == "" {
		t.Skip("needs a real cluster, kernel NBD and stor-csi: run by internal/vmtest (make vm)")
	}
	dir := os.Getenv("STOR_CSI_DIR")
	if dir == "" {
		dir = t.TempDir()
	}
	e := &external{
		t: t, bin: os.Getenv("STOR_CSI_BIN"), servers: os.Getenv("STOR_SERVER"), node: os.Getenv("STOR_CSI_NODE_ID"),
		dir: dir, endpoint: "unix://" + filepath.Join(dir, "csi.sock"), stateD: filepath.Join(dir, "state"),
	}
	if e.bin == "" || e.servers == "" || e.node == "" {
		t.Fatal("STOR_CSI_BIN, STOR_SERVER and STOR_CSI_NODE_ID must be set")
	}
	if tlsDir := os.Getenv("STOR_CSI_TLS_DIR"); tlsDir != "" {
		e.ctrlEndpoint = "unix://" + filepath.Join(dir, "controller.sock")
		e.plugins = []*plugin{
			{mode: "controller", endpoint: e.ctrlEndpoint, log: "stor-csi-controller.log",
				tls: pki.LocalFiles(tlsDir, pki.Identity{Role: pki.RoleCSIController, Name: "stor-csi"})},
			{mode: "node", endpoint: e.endpoint, log: "stor-csi.log",
				tls: pki.LocalFiles(tlsDir, pki.Identity{Role: pki.RoleCSINode, Name: e.node})},
		}
	} else {
		e.ctrlEndpoint = e.endpoint
		e.plugins = []*plugin{{mode: "all", endpoint: e.endpoint, log: "stor-csi.log"}}
	}
	for _, p := range e.plugins {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p.health = lis.Addr().String()
		lis.Close()
	}
	e.start()
	t.Cleanup(func() { e.stop(false) })
	e.conn = dialCSI(t, e.endpoint)
	e.ctrl, e.nd, e.id = csipb.NewControllerClient(dialCSI(t, e.ctrlEndpoint)), csipb.NewNodeClient(e.conn), csipb.NewIdentityClient(e.conn)
	e.waitReady()
	return e
}

// start runs the plugin processes in the background.
func (e *external) start() {
	e.t.Helper()
	for _, p := range e.plugins {
		f, err := os.OpenFile(filepath.Join(e.dir, p.log), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
		if err != nil {
			e.t.Fatal(err)
		}
		p.logf = f
		args := []string{"--mode=" + p.mode, "--endpoint", p.endpoint, "--servers", e.servers, "--health-listen", p.health}
		if p.mode != "controller" { // the node flags, which the controller refuses
			args = append(args, "--node-id", e.node, "--state-dir", e.stateD)
			if m := os.Getenv("STOR_CSI_MAX_VOLUMES"); m != "" {
				args = append(args, "--max-volumes", m)
			}
		}
		if p.tls.Set() {
			args = append(args, "--tls-cert", p.tls.Cert, "--tls-key", p.tls.Key, "--tls-ca", p.tls.CA)
		}
		p.cmd = exec.Command(e.bin, args...)
		p.cmd.Stdout, p.cmd.Stderr = f, f
		if err := p.cmd.Start(); err != nil {
			e.t.Fatal(err)
		}
	}
}

// stop ends the plugin processes: SIGTERM (the node plugin leaves devices
// for the next start), or SIGKILL.
func (e *external) stop(kill bool) {
	for _, p := range e.plugins {
		if p.cmd == nil {
			continue
		}
		if kill {
			p.cmd.Process.Kill()
		} else {
			p.cmd.Process.Signal(unix.SIGTERM)
		}
		done := make(chan struct{})
		go func() { p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			p.cmd.Process.Kill()
			<-done
		}
		p.cmd = nil
		p.logf.Close()
	}
}

// waitReady polls every plugin's /readyz (the controller: the cluster has
// a leader; the node: registered, staged volumes recovered) until it
// answers 200.
func (e *external) waitReady() {
	e.t.Helper()
	deadline := time.Now().Add(120 * time.Second)
	hc := &http.Client{Timeout: 5 * time.Second}
	for _, p := range e.plugins {
		for {
			resp, err := hc.Get("http://" + p.health + "/readyz")
			if err == nil {
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					break
				}
				err = fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(body))
			}
			if time.Now().After(deadline) {
				e.t.Fatalf("stor-csi --mode=%s not ready within 120s: %v", p.mode, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
}

// csi-sanity's tests (both access types; GINKGO focus from
// $STOR_CSI_SANITY_FOCUS) against the real plugin.
func TestExternalSanity(t *testing.T) {
	e := needExternal(t)
	endpoint := e.endpoint
	if e.ctrlEndpoint != e.endpoint {
		endpoint = sanityFront(t, e)
	}
	mountCfg := sanityConfig(endpoint, e.dir, "mount")
	blockCfg := sanityConfig(endpoint, e.dir, "block")
	for _, c := range []*sanity.TestConfig{mountCfg, blockCfg} {
		c.TestVolumeSize = 64 << 20
		c.TestVolumeExpandSize = 96 << 20
		c.IdempotentCount = 2
	}
	Describe("access type mount", func() { sanity.GinkgoTest(mountCfg) })
	Describe("access type block", func() { sanity.GinkgoTest(blockCfg) })
	RegisterFailHandler(Fail)
	suite, reporter := GinkgoConfiguration()
	if f := os.Getenv("STOR_CSI_SANITY_FOCUS"); f != "" {
		suite.FocusStrings = append(suite.FocusStrings, f)
	}
	suite.Timeout = 10 * time.Minute
	reporter.Verbose = testing.Verbose()
	RunSpecs(t, "stor CSI sanity (real kernel)", suite, reporter)
}

func mountCap() *csipb.VolumeCapability { return mountCapFS("ext4") }

func mountCapFS(fsType string) *csipb.VolumeCapability {
	return &csipb.VolumeCapability{
		AccessType: &csipb.VolumeCapability_Mount{Mount: &csipb.VolumeCapability_MountVolume{FsType: fsType}},
		AccessMode: &csipb.VolumeCapability_AccessMode{Mode: csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

// staged is a volume taken through kubelet's order up to published.
type staged struct {
	id, staging, target string
	vc                  *csipb.VolumeCapability
	pub                 map[string]string // ControllerPublish's publish context
}

func (e *external) createAndMount(ctx context.Context, name string, size int64, src *csipb.VolumeContentSource) staged {
	e.t.Helper()
	return e.createAndMountFS(ctx, name, size, src, mountCap())
}

func (e *external) createAndMountFS(ctx context.Context, name string, size int64, src *csipb.VolumeContentSource, vc *csipb.VolumeCapability) staged {
	e.t.Helper()
	vol, err := e.ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{
		Name: name, CapacityRange: &csipb.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csipb.VolumeCapability{vc}, VolumeContentSource: src,
		AccessibilityRequirements: &csipb.TopologyRequirement{Preferred: []*csipb.Topology{{Segments: map[string]string{"topology." + DefaultDriverName + "/node": e.node}}}},
	})
	if err != nil {
		e.t.Fatalf("CreateVolume %s: %v", name, err)
	}
	s := staged{id: vol.GetVolume().GetVolumeId(), staging: filepath.Join(e.dir, name+"-staging"), target: filepath.Join(e.dir, name+"-target"), vc: vc}
	pub, err := e.ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: s.id, NodeId: e.node, VolumeCapability: vc})
	if err != nil {
		e.t.Fatalf("ControllerPublishVolume %s: %v", name, err)
	}
	s.pub = pub.GetPublishContext()
	if err := os.MkdirAll(s.staging, 0o750); err != nil {
		e.t.Fatal(err)
	}
	e.stageAndPublish(ctx, s)
	return s
}

// stageAndPublish is NodeStage then NodePublish of a controller-published
// volume.
func (e *external) stageAndPublish(ctx context.Context, s staged) {
	e.t.Helper()
	if _, err := e.nd.NodeStageVolume(ctx, &csipb.NodeStageVolumeRequest{VolumeId: s.id, StagingTargetPath: s.staging,
		VolumeCapability: s.vc, PublishContext: s.pub}); err != nil {
		e.t.Fatalf("NodeStageVolume %s: %v", s.id, err)
	}
	if _, err := e.nd.NodePublishVolume(ctx, &csipb.NodePublishVolumeRequest{VolumeId: s.id, StagingTargetPath: s.staging,
		TargetPath: s.target, VolumeCapability: s.vc, PublishContext: s.pub}); err != nil {
		e.t.Fatalf("NodePublishVolume %s: %v", s.id, err)
	}
}

// unpublishAndUnstage is NodeUnpublish then NodeUnstage.
func (e *external) unpublishAndUnstage(ctx context.Context, s staged) {
	e.t.Helper()
	if _, err := e.nd.NodeUnpublishVolume(ctx, &csipb.NodeUnpublishVolumeRequest{VolumeId: s.id, TargetPath: s.target}); err != nil {
		e.t.Fatalf("NodeUnpublishVolume: %v", err)
	}
	if _, err := os.Stat(s.target); !os.IsNotExist(err) {
		e.t.Fatalf("the target path is still there after NodeUnpublish: %v", err)
	}
	if _, err := e.nd.NodeUnstageVolume(ctx, &csipb.NodeUnstageVolumeRequest{VolumeId: s.id, StagingTargetPath: s.staging}); err != nil {
		e.t.Fatalf("NodeUnstageVolume: %v", err)
	}
}

func (e *external) unmountAndDelete(ctx context.Context, s staged) {
	e.t.Helper()
	e.unpublishAndUnstage(ctx, s)
	if _, err := e.ctrl.ControllerUnpublishVolume(ctx, &csipb.ControllerUnpublishVolumeRequest{VolumeId: s.id, NodeId: e.node}); err != nil {
		e.t.Fatalf("ControllerUnpublishVolume: %v", err)
	}
	if _, err := e.ctrl.DeleteVolume(ctx, &csipb.DeleteVolumeRequest{VolumeId: s.id}); err != nil {
		e.t.Fatalf("DeleteVolume: %v", err)
	}
}

// writeFiles writes n files of 256 KiB with known contents and syncs
// them; it returns their checksums.
func writeFiles(t *testing.T, dir string, n int, seed byte) map[string][32]byte {
	t.Helper()
	sums := map[string][32]byte{}
	for i := range n {
		p := bytes.Repeat([]byte{seed + byte(i)}, 256<<10)
		copy(p, fmt.Sprintf("file %d seed %d", i, seed))
		name := filepath.Join(dir, fmt.Sprintf("f%02d", i))
		f, err := os.Create(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Write(p); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		f.Close()
		sums[filepath.Base(name)] = sha256.Sum256(p)
	}
	return sums
}

func verifyFiles(t *testing.T, dir string, sums map[string][32]byte) {
	t.Helper()
	for name, want := range sums {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatalf("read %s: %v", name, err)
		}
		if sha256.Sum256(b) != want {
			t.Fatalf("%s differs from what was written", name)
		}
	}
}

func fsSize(t *testing.T, dir string) uint64 {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * uint64(st.Bsize)
}

// Kubelet's order: Create → ControllerPublish → Stage → Publish → write
// files → online expand (controller + node; the filesystem grows) →
// Unpublish → Unstage → Stage → Publish (the files are there, the size
// stays) → Unpublish → Unstage → ControllerUnpublish → Delete. On ext4,
// 64 MiB grown to 128 MiB.
func TestExternalKubeletOrder(t *testing.T) {
	kubeletOrder(t, "ext4", 64<<20, 128<<20)
}

// The same on xfs. mkfs.xfs (xfsprogs 5.19 and later) refuses a
// filesystem under 300 MiB: 320 MiB grown to 448 MiB.
func TestExternalKubeletOrderXFS(t *testing.T) {
	kubeletOrder(t, "xfs", 320<<20, 448<<20)
}

func kubeletOrder(t *testing.T, fsType string, size, grown int64) {
	e := needExternal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	vc := mountCapFS(fsType)
	s := e.createAndMountFS(ctx, "kubelet-"+fsType, size, nil, vc)
	if got := mountedFSType(t, s.target); got != fsType {
		t.Fatalf("%s is mounted as %q, want %q", s.target, got, fsType)
	}
	sums := writeFiles(t, s.target, 8, 1)
	t.Logf("PASS: staged, published (%s) and wrote 8 files on %s", fsType, s.target)

	before := fsSize(t, s.target)
	exp, err := e.ctrl.ControllerExpandVolume(ctx, &csipb.ControllerExpandVolumeRequest{VolumeId: s.id,
		CapacityRange: &csipb.CapacityRange{RequiredBytes: grown}, VolumeCapability: vc})
	if err != nil || !exp.GetNodeExpansionRequired() {
		t.Fatalf("ControllerExpandVolume: %v (node expansion required %v)", err, exp.GetNodeExpansionRequired())
	}
	if _, err := e.nd.NodeExpandVolume(ctx, &csipb.NodeExpandVolumeRequest{VolumeId: s.id, VolumePath: s.target,
		StagingTargetPath: s.staging, CapacityRange: &csipb.CapacityRange{RequiredBytes: grown}, VolumeCapability: vc}); err != nil {
		t.Fatalf("NodeExpandVolume: %v", err)
	}
	after := fsSize(t, s.target)
	if after < before+uint64(grown-size)*3/4 {
		t.Fatalf("the filesystem is %d bytes after expanding %d -> %d bytes (was %d)", after, size, grown, before)
	}
	t.Logf("PASS: online expand (%s): filesystem %d -> %d bytes", fsType, before, after)
	stats, err := e.nd.NodeGetVolumeStats(ctx, &csipb.NodeGetVolumeStatsRequest{VolumeId: s.id, VolumePath: s.target})
	if err != nil || len(stats.GetUsage()) != 2 || stats.GetUsage()[0].GetTotal() != int64(after) {
		t.Fatalf("NodeGetVolumeStats: %v %v", stats, err)
	}
	verifyFiles(t, s.target, sums)

	e.unpublishAndUnstage(ctx, s)
	e.stageAndPublish(ctx, s)
	if got := mountedFSType(t, s.target); got != fsType {
		t.Fatalf("restaged: %s is mounted as %q, want %q", s.target, got, fsType)
	}
	if got := fsSize(t, s.target); got != after {
		t.Fatalf("restaged: the filesystem is %d bytes, was %d before unstaging", got, after)
	}
	verifyFiles(t, s.target, sums)
	t.Logf("PASS: restaged (%s): 8 files verify, filesystem %d bytes", fsType, after)
	e.unmountAndDelete(ctx, s)
	t.Logf("PASS: unpublished, unstaged, unpublished from the node, deleted")
}

// mountedFSType is the type /proc/self/mountinfo gives the mount at dir.
func mountedFSType(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	fstype := ""
	for line := range strings.SplitSeq(string(b), "\n") {
		// id parent major:minor root mountpoint opts [optional...] - fstype source superopts
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		f, g := strings.Fields(pre), strings.Fields(post)
		if len(f) >= 5 && len(g) >= 1 && f[4] == dir {
			fstype = g[0] // the last mount on dir is the visible one
		}
	}
	return fstype
}

// CreateSnapshot while writing, CreateVolume from the snapshot, stage the
// clone and verify the files as of the snapshot. Needs the snapshot and
// clone data path (replica layer cut, server-side copy).
func TestExternalSnapshotClone(t *testing.T) {
	e := needExternal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	s := e.createAndMount(ctx, "snapsrc", 64<<20, nil)
	sums := writeFiles(t, s.target, 8, 7)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var writeErr atomic.Value
	wg.Add(1)
	go func() { // a writer running while the snapshot is cut
		defer wg.Done()
		f, err := os.Create(filepath.Join(s.target, "during"))
		if err != nil {
			writeErr.Store(err)
			return
		}
		defer f.Close()
		buf := bytes.Repeat([]byte{0x42}, 64<<10)
		for i := 0; i < 200; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := f.Write(buf); err != nil {
				writeErr.Store(err)
				return
			}
			if i%8 == 0 {
				f.Sync()
			}
		}
	}()
	snap, err := e.ctrl.CreateSnapshot(ctx, &csipb.CreateSnapshotRequest{SourceVolumeId: s.id, Name: "snap1"})
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("CreateSnapshot: %v", err)
	}
	if v := writeErr.Load(); v != nil {
		t.Fatalf("the writer failed while the snapshot was cut: %v", v)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for !snap.GetSnapshot().GetReadyToUse() {
		if time.Now().After(deadline) {
			t.Fatal("the snapshot is not ready to use after 2 minutes")
		}
		time.Sleep(500 * time.Millisecond)
		l, err := e.ctrl.ListSnapshots(ctx, &csipb.ListSnapshotsRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()})
		if err != nil || len(l.GetEntries()) != 1 {
			t.Fatalf("ListSnapshots: %v %v", l, err)
		}
		snap = &csipb.CreateSnapshotResponse{Snapshot: l.GetEntries()[0].GetSnapshot()}
	}
	// Files written after the cut must not matter: overwrite them.
	writeFiles(t, s.target, 8, 99)
	src := &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Snapshot{
		Snapshot: &csipb.VolumeContentSource_SnapshotSource{SnapshotId: snap.GetSnapshot().GetSnapshotId()}}}
	var clone staged
	deadline = time.Now().Add(2 * time.Minute)
	for { // a clone is not attachable until its copy is done
		cl, err := e.ctrl.CreateVolume(ctx, &csipb.CreateVolumeRequest{Name: "clone1",
			CapacityRange:      &csipb.CapacityRange{RequiredBytes: 64 << 20},
			VolumeCapabilities: []*csipb.VolumeCapability{mountCap()}, VolumeContentSource: src})
		if err != nil {
			t.Fatalf("CreateVolume from the snapshot: %v", err)
		}
		_, err = e.ctrl.ControllerPublishVolume(ctx, &csipb.ControllerPublishVolumeRequest{VolumeId: cl.GetVolume().GetVolumeId(), NodeId: e.node, VolumeCapability: mountCap()})
		if err == nil {
			clone = e.createAndMount(ctx, "clone1", 64<<20, src)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the clone is not attachable after 2 minutes: %v", err)
		}
		time.Sleep(time.Second)
	}
	verifyFiles(t, clone.target, sums)
	t.Logf("PASS: the clone holds the files as of the snapshot")
	e.unmountAndDelete(ctx, clone)
	if _, err := e.ctrl.DeleteSnapshot(ctx, &csipb.DeleteSnapshotRequest{SnapshotId: snap.GetSnapshot().GetSnapshotId()}); err != nil {
		t.Fatal(err)
	}
	e.unmountAndDelete(ctx, s)
}

// Restart the node plugin (kill -9) with a volume mounted and a writer
// running: no I/O error, the data verifies (read back after dropping the
// page cache, so from the device).
func TestExternalPluginRestart(t *testing.T) {
	e := needExternal(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	s := e.createAndMount(ctx, "restart", 64<<20, nil)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var writeErr atomic.Value
	var written atomic.Int64
	h := sha256.New()
	wg.Add(1)
	go func() { // 4 KiB records, fsync every 16; at most 32 MiB
		defer wg.Done()
		f, err := os.Create(filepath.Join(s.target, "log"))
		if err != nil {
			writeErr.Store(err)
			return
		}
		defer f.Close()
		for i := 0; i < 8192; i++ {
			select {
			case <-stop:
				f.Sync()
				return
			default:
			}
			rec := bytes.Repeat([]byte{byte(i)}, 4096)
			copy(rec, fmt.Sprintf("record %08d\n", i))
			if _, err := f.Write(rec); err != nil {
				writeErr.Store(err)
				return
			}
			h.Write(rec)
			if i%16 == 15 {
				if err := f.Sync(); err != nil {
					writeErr.Store(fmt.Errorf("fsync: %w", err))
					return
				}
			}
			written.Add(int64(len(rec)))
		}
	}()
	waitWritten := func(n int64, within time.Duration, what string) {
		t.Helper()
		deadline := time.Now().Add(within)
		for written.Load() < n && writeErr.Load() == nil {
			if time.Now().After(deadline) {
				t.Fatalf("the writer reached %d bytes, not %d, within %v %s", written.Load(), n, within, what)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitWritten(256<<10, 60*time.Second, "before the kill")
	e.stop(true) // kill -9
	killedAt := written.Load()
	t.Logf("killed stor-csi after %d bytes written", killedAt)
	restarted := time.Now()
	e.start()
	e.waitReady()
	t.Logf("stor-csi ready again %v after the kill", time.Since(restarted).Round(10*time.Millisecond))
	// Requests in flight at the kill wait for the kernel's request timeout
	// (30s) before they are resent: allow for that.
	waitWritten(killedAt+512<<10, 180*time.Second, "after the restart")
	close(stop)
	wg.Wait()
	if v := writeErr.Load(); v != nil {
		t.Fatalf("the writer saw an error across the plugin restart: %v", v)
	}
	t.Logf("PASS: the writer saw no error across a kill -9 of stor-csi (%d bytes before, %d in all)", killedAt, written.Load())
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0); err != nil {
		t.Logf("could not drop the page cache: %v", err)
	}
	f, err := os.Open(filepath.Join(s.target, "log"))
	if err != nil {
		t.Fatal(err)
	}
	h2 := sha256.New()
	io.Copy(h2, f)
	f.Close()
	if !bytes.Equal(h.Sum(nil), h2.Sum(nil)) {
		t.Fatal("the file read back differs from what was written")
	}
	t.Logf("PASS: data verifies")
	e.unmountAndDelete(ctx, s)
}
