package server_test

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

func httpGet(t *testing.T, addr, path string) (int, string) {
	t.Helper()
	hc := &http.Client{Timeout: 5 * time.Second}
	resp, err := hc.Get("http://" + addr + path)
	if err != nil {
		t.Fatalf("GET %s%s: %v", addr, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(b))
}

func waitHTTP(t *testing.T, addr, path string, want int, within time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		code, body := httpGet(t, addr, path)
		if code == want {
			return body
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s%s is %d %q after %v, want %d", addr, path, code, body, within, want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// /readyz on --metrics-listen answers what the gRPC readiness does: ready
// on every member once a leader is known, 503 on a follower cut off from
// the others (it loses its leader) while /healthz stays 200, ready again
// once healed; and the Raft series show it.
func TestHTTPReadyzFollowsLeader(t *testing.T) {
	c := servertest.NewCluster(t, servertest.Options{Configure: func(_ int, cfg *server.Config) {
		cfg.MetricsListen = "127.0.0.1:0"
	}})
	leader := c.Leader(10 * time.Second)
	addrs := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		addrs[i] = n.Server().MetricsAddr()
		waitHTTP(t, addrs[i], "/readyz", http.StatusOK, 10*time.Second)
	}
	victim := (leader + 1) % 3
	c.Partition(victim)
	if body := waitHTTP(t, addrs[victim], "/readyz", http.StatusServiceUnavailable, 15*time.Second); !strings.Contains(body, "leader") {
		t.Fatalf("/readyz of the partitioned follower says %q; want the reason (no leader)", body)
	}
	if code, _ := httpGet(t, addrs[victim], "/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz of the partitioned follower: %d, want 200", code)
	}
	if _, body := httpGet(t, addrs[victim], "/metrics"); !strings.Contains(body, "stor_raft_has_leader 0") {
		t.Fatalf("/metrics of the partitioned follower does not show it leaderless")
	}
	c.Heal()
	waitHTTP(t, addrs[victim], "/readyz", http.StatusOK, 15*time.Second)
	if _, body := httpGet(t, addrs[victim], "/metrics"); !strings.Contains(body, "stor_raft_leader_changes_total") {
		t.Fatalf("/metrics lacks stor_raft_leader_changes_total")
	}
}

// A server that has not joined serves /readyz 503 from the start (the
// listener comes up before the join), /healthz 200.
func TestHTTPReadyzBeforeJoining(t *testing.T) {
	cfg := servertest.TestConfig()
	cfg.ID = "stor-server-1" // not ordinal 0: joins, never bootstraps
	cfg.DataDir = t.TempDir()
	cfg.Listen, cfg.RaftListen, cfg.DataListen, cfg.MetricsListen = "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:0"
	cfg.Join = []string{"127.0.0.1:1"} // nothing listens on port 1
	s, err := server.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Kill() })
	if code, _ := httpGet(t, s.MetricsAddr(), "/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz: %d", code)
	}
	time.Sleep(500 * time.Millisecond)
	if code, body := httpGet(t, s.MetricsAddr(), "/readyz"); code != http.StatusServiceUnavailable {
		t.Fatalf("/readyz of a server that never joined: %d %q, want 503", code, body)
	}
}
