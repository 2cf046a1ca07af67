package server_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
	"github.com/stor-io/stor/raftstore"
)

func loopbackConfig(t *testing.T, id, dir string) server.Config {
	cfg := server.DefaultConfig()
	cfg.ID, cfg.DataDir = id, dir
	cfg.Listen, cfg.RaftListen, cfg.DataListen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Capacity = 1 << 30
	cfg.Insecure = true
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
// bootstrapping again would make a second cluster under the same name. So
// with seeds answering: a stateless ordinal 0 that is not a member joins; one
// the cluster still counts as a member is refused, writing nothing, with the
// way out named; after "server remove" it joins afresh. With no seed
// answering (a first install, the others still starting) it bootstraps.
func TestOrdinalZeroWithoutStateNeverMakesASecondCluster(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	c.Leader(10 * time.Second)
	cl := c.Dial()
	clusterID := func(addr string) string {
		t.Helper()
		one, err := client.Dial([]string{addr})
		if err != nil {
			t.Fatal(err)
		}
		defer one.Close()
		st, err := one.Cluster.Status(ctxT(t, 5*time.Second), &storpb.StatusRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return st.ClusterId
	}
	want := clusterID(c.Nodes[0].Addr)
	seeds := []string{"127.0.0.1:1", c.Nodes[1].Addr} // one seed down, one in the cluster
	startZero := func() (*server.Server, string, error) {
		cfg := loopbackConfig(t, "stor-server-0", t.TempDir())
		cfg.Join = seeds
		srv, err := server.Start(cfg)
		return srv, cfg.DataDir, err
	}
	joined := func(srv *server.Server) {
		t.Helper()
		deadline := time.Now().Add(20 * time.Second)
		for clusterID(srv.Addr()) != want {
			if time.Now().After(deadline) {
				t.Fatalf("stor-server-0 did not join cluster %s (it reports %q)", want, clusterID(srv.Addr()))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	// Not a member: joins the existing cluster, does not bootstrap its own.
	srv, _, err := startZero()
	if err != nil {
		t.Fatalf("ordinal 0, not a member: %v", err)
	}
	joined(srv)
	srv.Kill()

	// Its disk is lost; the cluster still has it as a member: refused.
	srv, dir, err := startZero()
	if err == nil {
		srv.Kill()
		t.Fatal("ordinal 0 without state started although the cluster still has it as a member")
	}
	if !errors.Is(err, server.ErrSecondCluster) || !strings.Contains(err.Error(), "stor-ctl server remove stor-server-0") {
		t.Fatalf("refusal: %v, want ErrSecondCluster naming the way out", err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("a refused start wrote %d entries into the data dir (%s first)", len(entries), entries[0].Name())
	}

	// The operator removes it; it joins afresh. (Once the seed knows: a
	// follower may apply the removal after the leader answered it, and
	// until then a start is refused as above.)
	if _, err := cl.Cluster.Leave(ctxT(t, 10*time.Second), &storpb.LeaveRequest{ServerId: "stor-server-0"}); err != nil {
		t.Fatal(err)
	}
	seedKnows := func() bool {
		one, err := client.Dial([]string{c.Nodes[1].Addr})
		if err != nil {
			t.Fatal(err)
		}
		defer one.Close()
		st, err := one.Cluster.Status(ctxT(t, 5*time.Second), &storpb.StatusRequest{})
		return err == nil && !slices.ContainsFunc(st.Members, func(m *storpb.Member) bool { return m.Id == "stor-server-0" })
	}
	for deadline := time.Now().Add(10 * time.Second); !seedKnows(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("seed s2 still has stor-server-0 as a member 10 s after its removal")
		}
	}
	srv, _, err = startZero()
	if err != nil {
		t.Fatalf("ordinal 0 after server remove: %v", err)
	}
	joined(srv)
	srv.Kill()

	// Nobody answers: a first install bootstraps.
	cfg := loopbackConfig(t, "stor-server-0", t.TempDir())
	cfg.Join = []string{"127.0.0.1:1"}
	srv, err = server.Start(cfg)
	if err != nil {
		t.Fatalf("ordinal 0 with no seed answering: %v", err)
	}
	defer srv.Kill()
	deadline := time.Now().Add(20 * time.Second)
	for got := clusterID(srv.Addr()); got == "" || got == want; got = clusterID(srv.Addr()) {
		if time.Now().After(deadline) {
			t.Fatalf("ordinal 0 alone did not bootstrap a cluster of its own (it reports %q)", got)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// A start refused after the control API began serving stops serving: the
// connections it had taken are closed, and nothing answers on them. It
// closed only its listener, which ends accepting, not what was accepted:
// a client connected meanwhile kept being answered by a server that had
// returned an error from Start. The refusal here is ordinal 0 with an
// identity but no Raft state, which the cluster still counts as a member
// (a start that stopped between writing its identity and bootstrapping,
// then lost its disk's Raft state): that check runs with the API up.
func TestRefusedStartClosesWhatItServed(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{})
	c.Leader(10 * time.Second)
	seeds := []string{c.Nodes[1].Addr}
	cfg := loopbackConfig(t, "stor-server-0", t.TempDir())
	cfg.Join = seeds
	srv, err := server.Start(cfg)
	if err != nil {
		t.Fatalf("ordinal 0, not a member: %v", err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		st, err := c.Client(1).Cluster.Status(ctxT(t, 5*time.Second), &storpb.StatusRequest{})
		if err == nil && slices.ContainsFunc(st.Members, func(m *storpb.Member) bool { return m.Id == "stor-server-0" }) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("stor-server-0 did not join")
		}
		time.Sleep(100 * time.Millisecond)
	}
	srv.Kill()

	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "identity.json"), []byte(`{"server_id": "stor-server-0"}`), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg = loopbackConfig(t, "stor-server-0", dir)
	cfg.Join = seeds
	// The seed's answer, which refuses the start, waits until the client
	// below was answered: the API serves between the two.
	served := make(chan struct{})
	cfg.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if addr == seeds[0] {
			select {
			case <-served:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		var d net.Dialer
		return d.DialContext(ctx, network, addr)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Listener = lis
	// A client that calls the server while it starts: answered once the
	// API serves.
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	api := storpb.NewClusterServiceClient(cc)
	answered := make(chan bool, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_, err := api.Status(ctx, &storpb.StatusRequest{}, grpc.WaitForReady(true))
		answered <- err == nil
		close(served)
	}()
	if srv, err := server.Start(cfg); err == nil {
		srv.Kill()
		t.Fatal("ordinal 0 without Raft state started although the cluster still has it as a member")
	} else if !errors.Is(err, server.ErrSecondCluster) {
		t.Fatalf("refusal: %v, want ErrSecondCluster", err)
	}
	if !<-answered {
		t.Fatal("the client was not answered while the server started: the test shows nothing")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := api.Status(ctx, &storpb.StatusRequest{}); err == nil {
		t.Fatal("a server whose Start returned an error still answers on a connection it took while starting")
	}
}
