package server_test

import (
	"testing"
	"time"

	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/internal/server"
)

// source loads a server certificate for id from a CA made in a temporary
// directory.
func source(t *testing.T, id string) *pki.Source {
	t.Helper()
	dir := t.TempDir()
	self := pki.Identity{Role: pki.RoleServer, Name: id}
	if err := pki.EnsureLocal(dir, self); err != nil {
		t.Fatal(err)
	}
	src, err := pki.Load(pki.LocalFiles(dir, self), nil)
	if err != nil {
		t.Fatal(err)
	}
	return src
}

func TestShouldBootstrap(t *testing.T) {
	seeds := []string{"stor-0.stor:7400", "stor-1.stor:7400", "stor-2.stor:7400"}
	cases := []struct {
		id   string
		join []string
		want bool
	}{
		{"s1", nil, true},                        // no seeds: a new cluster
		{"laptop-3", nil, true},                  // an ordinal-looking name without seeds still bootstraps
		{"stor-server-0", seeds, true},           // StatefulSet ordinal 0 bootstraps...
		{"stor-server-1", seeds, false},          // ...every other ordinal joins
		{"stor-server-12", seeds, false},         //
		{"stor-server-00", seeds, true},          // ordinal 0 however it is spelled
		{"s2", []string{"10.0.0.1:7400"}, false}, // not a StatefulSet name: join
		{"stor-server-x", seeds, false},
	}
	for _, tc := range cases {
		if got := server.ShouldBootstrap(tc.id, tc.join); got != tc.want {
			t.Errorf("ShouldBootstrap(%q, %d seeds) = %v, want %v", tc.id, len(tc.join), got, tc.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	cases := []struct {
		name  string
		edit  func(c *server.Config)
		valid bool
	}{
		{"defaults", func(c *server.Config) { c.ID = "s1" }, true},
		{"neither TLS nor insecure", func(c *server.Config) { c.ID = "s1"; c.Insecure = false }, false},
		{"empty id", func(c *server.Config) { c.ID = "" }, false},
		{"id with a slash", func(c *server.Config) { c.ID = "a/b" }, false},
		{"no data dir", func(c *server.Config) { c.ID = "s1"; c.DataDir = "" }, false},
		{"bad listen address", func(c *server.Config) { c.ID = "s1"; c.Listen = "7400" }, false},
		{"keepalive min time of 10 s", func(c *server.Config) { c.ID = "s1"; c.API.KeepaliveMinTime = 10 * time.Second }, true},
		{"keepalive min time over the clients' 10 s pings", func(c *server.Config) { c.ID = "s1"; c.API.KeepaliveMinTime = 11 * time.Second }, false},
		{"bad join address", func(c *server.Config) { c.ID = "s1"; c.Join = []string{"nohost"} }, false},
		{"down timeout below heartbeat", func(c *server.Config) { c.ID = "s1"; c.Raft.ServerDownTimeout = c.HeartbeatInterval }, false},
		{"replicas over the limit", func(c *server.Config) { c.ID = "s1"; c.DefaultReplicas = 99 }, false},
		{"insecure on loopback", func(c *server.Config) { c.ID = "s1"; c.Insecure = true; c.Join = []string{"127.0.0.1:7410"} }, true},
		{"insecure listening everywhere", func(c *server.Config) { c.ID = "s1"; c.Insecure = true; c.DataListen = ":7402" }, false},
		{"insecure advertising a LAN address", func(c *server.Config) { c.ID = "s1"; c.Insecure = true; c.Advertise = "10.0.0.1:7400" }, false},
		{"insecure joining a DNS name", func(c *server.Config) { c.ID = "s1"; c.Insecure = true; c.Join = []string{"stor-0.stor:7400"} }, false},
		{"TLS and insecure", func(c *server.Config) { c.ID = "s1"; c.TLS = source(t, "s1"); c.Insecure = true }, false},
		{"TLS certificate of this id", func(c *server.Config) { c.ID = "s1"; c.TLS = source(t, "s1"); c.Insecure = false }, true},
		{"TLS certificate of another id", func(c *server.Config) { c.ID = "s1"; c.TLS = source(t, "s2"); c.Insecure = false }, false},
	}
	for _, tc := range cases {
		// Insecure (on the default loopback addresses) unless a case says
		// otherwise, so that each case fails, if it does, for its own reason.
		cfg := server.DefaultConfig()
		cfg.Insecure = true
		tc.edit(&cfg)
		if err := cfg.Validate(); (err == nil) != tc.valid {
			t.Errorf("%s: Validate() = %v, want valid=%v", tc.name, err, tc.valid)
		}
	}
}
