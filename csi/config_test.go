package csi

import (
	"strings"
	"testing"

	storpb "github.com/stor-io/stor/api/proto"
)

// The node's fields do nothing in controller mode; Validate refuses them
// there with a message naming the flag, and accepts them in node and all
// mode.
func TestValidateRefusesNodeFieldsInControllerMode(t *testing.T) {
	cluster := Cluster{
		Cluster: storpb.NewClusterServiceClient(nil), Volumes: storpb.NewVolumeServiceClient(nil),
		Snapshots: storpb.NewSnapshotServiceClient(nil),
	}
	for _, tc := range []struct {
		name string
		set  func(*Config)
		want string // "" accepted
	}{
		{"controller, no node fields", func(*Config) {}, ""},
		{"controller with a node id", func(c *Config) { c.NodeID = "worker-1" }, "NodeID (--node-id) is for node mode; controller mode does not use it"},
		{"controller with a zone", func(c *Config) { c.Zone = "a" }, "Zone (--zone) is for node mode"},
		{"controller with a state dir", func(c *Config) { c.StateDir = DefaultStateDir }, "StateDir (--state-dir) is for node mode"},
		{"controller with a volume limit", func(c *Config) { c.MaxVolumesPerNode = 8 }, "MaxVolumesPerNode (--max-volumes) is for node mode"},
		{"controller with a rebuild shape", func(c *Config) { c.RebuildInFlight = 2 }, "RebuildInFlight (--rebuild-in-flight) is for node mode"},
		{"node rebuilding too many chunks at once", func(c *Config) {
			c.Mode, c.NodeID, c.RebuildInFlight = ModeNode, "worker-1", 65
		}, "RebuildInFlight (--rebuild-in-flight) 65: want 1 to 64"},
		{"node rebuilding a negative count", func(c *Config) {
			c.Mode, c.NodeID, c.RebuildInFlight = ModeNode, "worker-1", -1
		}, "want 1 to 64"},
		{"node with all of them", func(c *Config) {
			c.Mode, c.NodeID, c.Zone, c.StateDir, c.MaxVolumesPerNode, c.RebuildInFlight = ModeNode, "worker-1", "a", "/x", 8, 1
		}, ""},
		{"all with all of them", func(c *Config) {
			c.Mode, c.NodeID, c.Zone, c.StateDir, c.MaxVolumesPerNode = ModeAll, "worker-1", "a", "/x", 8
		}, ""},
		// The kubelet could not label nodes with this driver's topology
		// keys (NodeRestriction): the driver would never register.
		{"driver name under k8s.io", func(c *Config) { c.DriverName = "stor.csi.k8s.io" }, "NodeRestriction"},
		{"driver name under kubernetes.io", func(c *Config) { c.DriverName = "csi.kubernetes.io" }, "NodeRestriction"},
		{"the default driver name", func(c *Config) { c.DriverName = DefaultDriverName }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Mode, cfg.Cluster = ModeController, cluster
			tc.set(&cfg)
			cfg.defaults()
			err := cfg.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Validate: %v, want nil", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("Validate: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
