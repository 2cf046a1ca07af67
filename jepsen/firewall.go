package jepsen

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"strings"
	"time"
)

// The nftables table each host filters its traffic with: an input and an
// output chain, empty (accepting everything) while the network is healthy.
const nftTable = Prefix

func nft(ctx context.Context, h *Host, script string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "ip", "netns", "exec", h.Name, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("nft in %s: %w: %s\nscript:\n%s", h.Name, err, bytes.TrimSpace(out), script)
	}
	return nil
}

func initFirewall(ctx context.Context, h *Host) error {
	return nft(ctx, h, fmt.Sprintf(`table inet %[1]s {
	chain in { type filter hook input priority 0; policy accept; }
	chain out { type filter hook output priority 0; policy accept; }
}
`, nftTable))
}

// Drop makes every packet from host a to host b disappear (one way:
// b's packets to a still arrive). The rule is installed on both sides
// (a's output and b's input), as a cut cable would.
func Drop(ctx context.Context, a, b *Host) error {
	if err := nft(ctx, a, fmt.Sprintf("add rule inet %s out ip daddr %s drop\n", nftTable, b.Addr)); err != nil {
		return err
	}
	return nft(ctx, b, fmt.Sprintf("add rule inet %s in ip saddr %s drop\n", nftTable, a.Addr))
}

// Cut drops all traffic between a and b, both ways.
func Cut(ctx context.Context, a, b *Host) error {
	if err := Drop(ctx, a, b); err != nil {
		return err
	}
	return Drop(ctx, b, a)
}

// HealAll removes every drop rule on every host.
func (n *Net) HealAll(ctx context.Context) error {
	var first error
	for _, h := range n.Hosts {
		err := nft(ctx, h, fmt.Sprintf("flush chain inet %[1]s in\nflush chain inet %[1]s out\n", nftTable))
		if err != nil && first == nil {
			first = err
		}
	}
	return first
}
