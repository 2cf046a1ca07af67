package server_test

import (
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/raftstore"
)

func loopbackConfig(t *testing.T, id, dir string) server.Config {
	cfg := server.DefaultConfig()
	cfg.ID, cfg.DataDir = id, dir
	cfg.Listen, cfg.RaftListen, cfg.DataListen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Capacity = 1 << 30
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	return cfg
}

// initDataDir runs a one-server cluster in dir until it leads, then stops it.
func initDataDir(t *testing.T, id, dir string) {
	t.Helper()
	srv, err := server.Start(loopbackConfig(t, id, dir))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	hasClusterID := func() bool {
		b, _ := os.ReadFile(filepath.Join(dir, "identity.json"))
		return strings.Contains(string(b), `"cluster_id"`)
	}
	for !srv.Store().IsLeader() || !hasClusterID() {
		if time.Now().After(deadline) {
			t.Fatal("single server did not become leader")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
}

func dirListing(t *testing.T, dir string) string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		info, _ := e.Info()
		names = append(names, e.Name()+":"+info.ModTime().String())
	}
	return strings.Join(names, ",")
}

func TestDataDirRefusals(t *testing.T) {
	cases := []struct {
		name    string
		prepare func(t *testing.T, dir string) // leaves dir in the state under test
		id      string
		want    error
		msg     []string // substrings the error must contain
	}{
		{"unrelated files", func(t *testing.T, dir string) {
			os.MkdirAll(dir, 0o700)
			os.WriteFile(filepath.Join(dir, "postgres.conf"), []byte("x"), 0o600)
		}, "s1", raftstore.ErrForeignDataDir, []string{"not a stor data directory", "postgres.conf"}},
		{"another server's dir", func(t *testing.T, dir string) {
			initDataDir(t, "s1", dir)
		}, "s9", raftstore.ErrForeignDataDir, []string{`"s1"`, `"s9"`}},
		{"corrupt raft log", func(t *testing.T, dir string) {
			initDataDir(t, "s1", dir)
			os.WriteFile(filepath.Join(dir, "raft.db"), []byte(strings.Repeat("garbage", 2000)), 0o600)
		}, "s1", raftstore.ErrCorrupt, []string{"raft.db"}},
		{"corrupt metadata", func(t *testing.T, dir string) {
			initDataDir(t, "s1", dir)
			os.WriteFile(filepath.Join(dir, "meta.db"), []byte(strings.Repeat("garbage", 2000)), 0o600)
		}, "s1", raftstore.ErrCorrupt, []string{"meta.db"}},
		{"raft state deleted", func(t *testing.T, dir string) {
			initDataDir(t, "s1", dir)
			os.Remove(filepath.Join(dir, "raft.db"))
		}, "s1", raftstore.ErrCorrupt, []string{"Raft state", "refusing to start a new cluster"}},
		{"corrupt identity", func(t *testing.T, dir string) {
			initDataDir(t, "s1", dir)
			os.WriteFile(filepath.Join(dir, "identity.json"), []byte("{not json"), 0o600)
		}, "s1", raftstore.ErrCorrupt, []string{"identity"}},
		{"state without identity", func(t *testing.T, dir string) {
			initDataDir(t, "s1", dir)
			os.Remove(filepath.Join(dir, "identity.json"))
		}, "s1", raftstore.ErrCorrupt, []string{"no identity.json"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "data")
			tc.prepare(t, dir)
			before := dirListing(t, dir)
			srv, err := server.Start(loopbackConfig(t, tc.id, dir))
			if err == nil {
				srv.Kill()
				t.Fatalf("server started on %s", tc.name)
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			for _, m := range tc.msg {
				if !strings.Contains(err.Error(), m) {
					t.Fatalf("error %q does not mention %q", err, m)
				}
			}
			if after := dirListing(t, dir); after != before {
				t.Fatalf("refused start changed the data dir:\nbefore %s\nafter  %s", before, after)
			}
		})
	}
}

func TestDataDirInUseByAnotherServer(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	srv, err := server.Start(loopbackConfig(t, "s1", dir))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Kill()
	second, err := server.Start(loopbackConfig(t, "s1", dir))
	if err == nil {
		second.Kill()
		t.Fatal("a second server opened a data dir in use")
	}
	if !strings.Contains(err.Error(), "locked by another process") {
		t.Fatalf("error %q does not say the dir is locked", err)
	}
}

func TestRestartResumesWithoutRebootstrap(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	initDataDir(t, "s1", dir)
	ident, err := os.ReadFile(filepath.Join(dir, "identity.json"))
	if err != nil {
		t.Fatal(err)
	}
	initDataDir(t, "s1", dir) // restart: resumes, same cluster
	again, _ := os.ReadFile(filepath.Join(dir, "identity.json"))
	if string(again) != string(ident) || !strings.Contains(string(ident), `"member": true`) || !strings.Contains(string(ident), `"cluster_id"`) {
		t.Fatalf("identity changed across restart:\n%s\n%s", ident, again)
	}
}

// Ordinal 0 of a StatefulSet bootstraps when it has no state, which is how
// the first cluster is made. If its disk is lost while the cluster lives on,
// bootstrapping again would make a second cluster under the same name: the
// start is refused when a seed answers with a cluster id, and goes ahead
// when no seed answers (a first install, the others still starting).
func TestOrdinalZeroWithoutStateRefusesASecondCluster(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	c.Leader(10 * time.Second)

	cfg := loopbackConfig(t, "stor-server-0", t.TempDir())
	cfg.Join = []string{"127.0.0.1:1", c.Nodes[1].Addr} // one seed down, one in the cluster
	srv, err := server.Start(cfg)
	if err == nil {
		srv.Kill()
		t.Fatal("ordinal 0 without state bootstrapped beside a live cluster")
	}
	if !errors.Is(err, server.ErrSecondCluster) || !strings.Contains(err.Error(), "stor-ctl server remove stor-server-0") {
		t.Fatalf("refusal: %v, want ErrSecondCluster naming the way out", err)
	}
	if entries, _ := os.ReadDir(cfg.DataDir); len(entries) != 0 {
		t.Fatalf("a refused start wrote %d entries into the data dir (%s first)", len(entries), entries[0].Name())
	}

	cfg = loopbackConfig(t, "stor-server-0", t.TempDir())
	cfg.Join = []string{"127.0.0.1:1"} // nobody answers: a first install
	srv, err = server.Start(cfg)
	if err != nil {
		t.Fatalf("ordinal 0 with no seed answering: %v", err)
	}
	srv.Kill()
}
