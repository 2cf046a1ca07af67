package vmtest

import (
	"context"
	_ "embed"
	"strings"
	"sync"
	"testing"
	"time"
)

//go:embed testdata/csi.sh
var csiScript string

var (
	csiOnce sync.Once
	csiBins map[string]string
	csiErr  error
)

// csiBinaries adds stor-csi and package csi's test binary to the stor
// binaries.
func csiBinaries(t *testing.T) map[string]string {
	t.Helper()
	bins := storBinaries(t)
	csiOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		root, err := ModuleRoot(".")
		if err != nil {
			csiErr = err
			return
		}
		var b map[string]string
		if b, csiErr = BuildGo(ctx, root, buildDir, "./cmd/stor-csi"); csiErr != nil {
			return
		}
		var ct string
		if ct, csiErr = BuildTest(ctx, root, buildDir, "./csi"); csiErr != nil {
			return
		}
		csiBins = map[string]string{"stor-csi": b["stor-csi"], "csi.test": ct}
	})
	if csiErr != nil {
		t.Fatal(csiErr)
	}
	out := map[string]string{}
	for k, v := range bins {
		out[k] = v
	}
	for k, v := range csiBins {
		out[k] = v
	}
	return out
}

// csiScenario runs one of package csi's TestExternal* tests in the guest.
func csiScenario(t *testing.T, name, test, focus string, expect []string, timeout time.Duration) {
	env := Skip(t)
	bins := csiBinaries(t)
	s := StorScenario(name, bins, "CSI_TEST="+test+"\nCSI_FOCUS='"+focus+"'\n"+csiScript)
	s.Programs = append(s.Programs, "fsck.ext4")
	for _, b := range []string{"stor-csi", "csi.test"} {
		s.Files = append(s.Files, File{Guest: "/bin/" + b, Host: bins[b], Mode: 0o755})
	}
	s.Expect = append(expect, "VMTEST PASS: "+test+" passes")
	s.Timeout = timeout
	r := run(t, env, s)
	for _, m := range r.Markers() {
		if strings.Contains(m, "NOTE") {
			t.Log(m)
		}
	}
}

// csi-sanity, every spec, against stor-csi (controller and node in one
// process) with the real kernel NBD attach and real mounts, for the mount
// and block access types.
func TestVMCSISanity(t *testing.T) {
	csiScenario(t, "csi-sanity", "TestExternalSanity", "", []string{"SUCCESS!"}, 10*time.Minute)
}

// Kubelet's order through the CSI socket, with an online expansion.
func TestVMCSIKubeletOrder(t *testing.T) {
	csiScenario(t, "csi-kubelet-order", "TestExternalKubeletOrder", "",
		[]string{"PASS: staged, published and wrote 8 files", "PASS: online expand", "PASS: unpublished, unstaged"}, 6*time.Minute)
}

// kill -9 of the node plugin with a volume mounted and a writer running.
func TestVMCSIPluginRestart(t *testing.T) {
	csiScenario(t, "csi-plugin-restart", "TestExternalPluginRestart", "",
		[]string{"PASS: the writer saw no error", "PASS: data verifies"}, 6*time.Minute)
}

// Snapshot while writing, clone from it, the clone holds the files as of
// the snapshot. Needs the snapshot/clone data path (another branch).
func TestVMCSISnapshotClone(t *testing.T) {
	csiScenario(t, "csi-snapshot-clone", "TestExternalSnapshotClone", "",
		[]string{"PASS: the clone holds the files as of the snapshot"}, 6*time.Minute)
}
