package servertest

import (
	"net"
	"testing"
	"time"
)

// A stopped node's ports stay the cluster's until it starts again: no
// other process (another test binary's server) can take one in between
// and fail its restart. Closed, the cluster lets them go.
func TestAStoppedNodesPortsAreKept(t *testing.T) {
	c := NewCluster(t, Options{Servers: 1})
	n := c.Nodes[0]
	addrs := []string{n.Addr, n.RaftAddr, n.DataAddr}
	for _, stop := range []func(int){c.Kill, c.Stop} {
		stop(0)
		for _, addr := range addrs {
			if ln, err := net.Listen("tcp", addr); err == nil {
				ln.Close()
				t.Fatalf("another process could listen on %s while the node was stopped", addr)
			}
		}
		c.Start(0)
		c.Leader(20 * time.Second)
	}
	c.Close()
	for _, addr := range addrs {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatalf("%s is still kept once the cluster closed: %v", addr, err)
		}
		ln.Close()
	}
}
