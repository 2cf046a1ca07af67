package jepsen

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// Prefix names every network namespace, link and nftables table the
// harness creates, so that a crashed run's leftovers can be found and
// removed by the next one.
const Prefix = "storj"

// bridgeName is the bridge every host's veth joins; bridgeAddr is the
// root namespace's address on it (the harness process reaches the hosts
// through it).
const (
	bridgeName = Prefix + "br0"
	bridgeAddr = "198.18.0.1"
	netmask    = "/24"
)

// Host is one network namespace with its own address, joined by a veth
// pair to the harness's bridge.
type Host struct {
	Name string // namespace name, e.g. storj-s1
	Addr string // its address in 198.18.0.0/24
	veth string // the root side of its veth pair
}

// Net is the harness's hosts: a bridge and one namespace per host.
type Net struct {
	Hosts []*Host
}

// run runs a command, returning its combined output in the error.
func run(ctx context.Context, name string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// nsRun runs a command inside host h's namespace.
func nsRun(ctx context.Context, h *Host, name string, args ...string) error {
	return run(ctx, "ip", append([]string{"netns", "exec", h.Name, name}, args...)...)
}

// Cleanup removes every namespace and link a previous run left behind,
// killing the processes still inside those namespaces.
func Cleanup(ctx context.Context) {
	out, _ := exec.CommandContext(ctx, "ip", "netns", "list").Output()
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || !strings.HasPrefix(f[0], Prefix+"-") {
			continue
		}
		if pids, err := exec.CommandContext(ctx, "ip", "netns", "pids", f[0]).Output(); err == nil {
			for _, p := range strings.Fields(string(pids)) {
				_ = run(ctx, "kill", "-CONT", p)
				_ = run(ctx, "kill", "-9", p)
			}
		}
		_ = run(ctx, "ip", "netns", "del", f[0])
	}
	out, _ = exec.CommandContext(ctx, "ip", "-o", "link", "show").Output()
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
		if strings.HasPrefix(name, Prefix) {
			_ = run(ctx, "ip", "link", "del", name)
		}
	}
}

// NewNet creates the bridge and one host per name, host i at 198.18.0.(10+i).
// On error it removes what it created.
func NewNet(ctx context.Context, names []string) (_ *Net, err error) {
	n := &Net{}
	defer func() {
		if err != nil {
			n.Close()
		}
	}()
	if err := run(ctx, "ip", "link", "add", bridgeName, "type", "bridge"); err != nil {
		return nil, err
	}
	if err := run(ctx, "ip", "addr", "add", bridgeAddr+netmask, "dev", bridgeName); err != nil {
		return nil, err
	}
	if err := run(ctx, "ip", "link", "set", bridgeName, "up"); err != nil {
		return nil, err
	}
	for i, name := range names {
		h := &Host{Name: Prefix + "-" + name, Addr: fmt.Sprintf("198.18.0.%d", 10+i), veth: fmt.Sprintf("%sv%d", Prefix, i)}
		n.Hosts = append(n.Hosts, h)
		peer := h.veth + "p"
		steps := [][]string{
			{"ip", "netns", "add", h.Name},
			{"ip", "link", "add", h.veth, "type", "veth", "peer", "name", peer},
			{"ip", "link", "set", peer, "netns", h.Name},
			{"ip", "link", "set", h.veth, "master", bridgeName},
			{"ip", "link", "set", h.veth, "up"},
			{"ip", "netns", "exec", h.Name, "ip", "addr", "add", h.Addr + netmask, "dev", peer},
			{"ip", "netns", "exec", h.Name, "ip", "link", "set", peer, "up"},
			{"ip", "netns", "exec", h.Name, "ip", "link", "set", "lo", "up"},
		}
		for _, s := range steps {
			if err := run(ctx, s[0], s[1:]...); err != nil {
				return nil, err
			}
		}
		if err := initFirewall(ctx, h); err != nil {
			return nil, err
		}
	}
	return n, nil
}

// Host returns the host named name (without the prefix).
func (n *Net) Host(name string) *Host {
	for _, h := range n.Hosts {
		if h.Name == Prefix+"-"+name {
			return h
		}
	}
	return nil
}

// Close removes every namespace and link of n (and kills what still runs
// in them).
func (n *Net) Close() {
	Cleanup(context.Background())
}
